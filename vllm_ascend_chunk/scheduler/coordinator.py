"""ChunkCacheCoordinator: the scheduler-side logic behind the KV connector.

Life of a chunk-path request R (`SYS + C_1..C_n + Q`), as `ChunkPathStatus` transitions:
1. `on_new_request`: R is registered, WAITING.
2. `plan` (start of every `schedule()`), WAITING → PLANNED: pin the entries of SYS and every C_i;
   missing ones are created pending and one chunk prefill `SYS + C_i` is returned per
   missing chunk (the scheduler adds them as requests). Requests are planned in the scheduler's
   order (arrival, or priority); one the pool cannot take yet blocks only requests that would
   need new pool pages, never those whose chunks are all known (see `plan`).
3. While R waits, `get_num_new_matched_tokens` (side-effect free) answers None ("ask again")
   until every entry is resident, which does not block other requests; then the number of chunk
   tokens not in the prefix cache.
4. `update_state_after_alloc`, PLANNED → LOADING: the chunk region becomes a load (pool rows →
   R's slots), sent to the workers by `build_connector_meta`, LOADING → LOADED (pins released).
   If the prefix cache already holds the whole chunk region: straight to LOADED, no load.
5. The layout (`core/layouts.py`) places R's tokens: every step R computes tokens, their RoPE
   positions are lowered by `shift_at` (overlap); or its cached keys are re-rotated on
   load by `load_deltas` (sequential).
6. `on_preempted`, LOADED (or EXTERNAL) → WAITING (its blocks are gone: plan and load again);
   `request_finished`: pins released, R forgotten. `reset`: the pool is dropped and every
   PLANNED request is planned again (it must not load what the reset dropped).
On the decode instance of a P/D pair, R may instead be loaded by another connector (the KV the
prefill instance computed, `ChunkCacheMultiConnector`): `load_elsewhere`, WAITING → EXTERNAL, it
is never planned and the chunk cache only places its computed tokens (step 5);
`serve_here`, EXTERNAL → WAITING, if that connector no longer covers its chunk region. A request
with a recovery mode or a `cache_salt` is never EXTERNAL (`private`).
A `qattn` request (its `Selection`) then computes its own prefill in passes: the scheduler asks
`token_cap` how far it may compute and `reposition` where it continues, and the workers' scores
come back with the step's report (`RecomputePlanner`).
A prefill's tokens are copied from its paged-cache slots into its pending entries after each step
that computes them (`ChunkPrefills.saves`); when the prefill has sampled its token (its whole
prompt was computed and saved), `request_finished` marks them resident.

Tiers (`tiers.base`), built from the engine's settings by `tiers.registry.build_tiers`: the
manager offers missing keys to them in order; the entries a step's chunk prefills complete
(`ChunkPrefills.saves`) are offered to them to keep (`ChunkCacheManager.computed`), as evicted
entries are. The tiers' jobs are sent with the step, the workers' reports go back to the tiers,
and an entry a tier failed to fill while a request holds it is computed by a chunk prefill
(`ChunkCacheManager.take_refills`). This class names no tier.

Collaborators, one job each: `ChunkPrefills` (the hidden requests), `ChunkCacheManager` (the
pool and the tiers below it), `RecomputePlanner` (`qattn`/`cover` passes), `StepBuilder` (the
only writer of step metadata); this class holds the request state machine and calls them from
vLLM's hooks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm_ascend_chunk.config.settings import ChunkCacheConfig
from vllm_ascend_chunk.core.geometry import PoolGeometry
from vllm_ascend_chunk.core.layouts import LAYOUTS
from vllm_ascend_chunk.core.paging import slot_of
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata, ChunkCacheWorkerMetadata
from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager
from vllm_ascend_chunk.scheduler.prefills import ChunkPrefill, ChunkPrefills
from vllm_ascend_chunk.scheduler.recompute_plan import RecomputePlanner
from vllm_ascend_chunk.scheduler.requests import ChunkPathStatus, UserRequest
from vllm_ascend_chunk.scheduler.step_builder import StepBuilder
from vllm_ascend_chunk.tiers.registry import build_tiers

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.chunk_cache")


class ChunkCacheCoordinator:
    def __init__(
        self,
        geometry: PoolGeometry,
        block_size: int,
        settings: ChunkCacheConfig,
        priority_order: bool = False,
        ranks: int = 1,
    ) -> None:
        """`settings`: the engine's (`config.engine_settings.engine_settings`). `ranks`: the
        engine's worker ranks (each keeps its shard of an entry in a tier)."""
        self.geometry = geometry
        self.layout = LAYOUTS[settings.layout]
        self.block_size = block_size
        self.priority_order = priority_order
        """Plan in (priority, arrival) order, as vLLM's `--scheduling-policy priority` schedules."""
        self.manager = ChunkCacheManager(geometry.num_pages, geometry.page_size, settings.lru_threshold)
        build_tiers(settings, geometry, self.manager, ranks)
        self.users: dict[str, UserRequest] = {}
        self.chunk_prefills = ChunkPrefills(geometry.page_size, block_size)
        self.recompute = RecomputePlanner(self.users, self.layout, block_size, self.manager.stats)
        self._blocked: str | None = None
        """The request the pool could not take at the last `plan`, if any."""
        self._step = StepBuilder()

    @property
    def prefills(self) -> dict[str, ChunkPrefill]:
        """The chunk prefills in flight, by request id."""
        return self.chunk_prefills.by_id

    def take_prefill_ids_to_hide(self) -> set[str]:
        """Ids of chunk prefills whose outputs must not reach clients: running, or just ended."""
        return self.chunk_prefills.take_ids_to_hide()

    # -- planning (called by the scheduler before each schedule) -----------------------------
    def plan(self) -> list[ChunkPrefill]:
        """Plan WAITING requests in scheduling order and return the chunk prefills to add.

        The first request the pool cannot take (all entries at once) becomes the blocked head.
        Requests after it are planned only if they need no new pool pages (every chunk resident
        or in flight), and such a request that still waits at the next `plan` is unplanned
        before the head tries again, so the head sees the pool as if they had not come: it is
        never starved by requests behind it.
        """
        order = self._order()
        self._unplan_behind_blocked(order)
        prefills = self._refill()
        self._blocked = None
        for user in order:
            if user.status is not ChunkPathStatus.WAITING:
                continue
            needs = user.needs()
            if self._blocked is not None and self.manager.missing_pages(needs):
                continue
            acquired = self.manager.acquire(
                needs, chunk_keys=set(user.info.chunk_hashes), count=not user.counted
            )
            if acquired is None:
                self._blocked = user.request.request_id
                continue
            user.status, user.entries, user.counted = ChunkPathStatus.PLANNED, acquired.entries, True
            prefills += self.chunk_prefills.create(user, acquired.created)
        self.manager.stats.chunk_prefills += len(prefills)
        return prefills

    def _refill(self) -> list[ChunkPrefill]:
        """Chunk prefills for the entries a tier failed to fill."""
        prefills = []
        for entry in self.manager.take_refills():
            holder = next((u for u in self.users.values() if u.entries and entry in u.entries), None)
            if holder is None:  # its requests left (or were unplanned) since the fill failed
                self.manager.discard(entry)
            else:
                prefills += self.chunk_prefills.create(holder, [entry])
        return prefills

    def _order(self) -> list[UserRequest]:
        users = list(self.users.values())  # arrival order
        if self.priority_order:
            users.sort(key=lambda u: (u.request.priority, u.request.arrival_time))
        return users

    def _unplan_behind_blocked(self, order: list[UserRequest]) -> None:
        ids = [u.request.request_id for u in order]
        if self._blocked not in ids:
            return
        for user in order[ids.index(self._blocked) + 1 :]:
            if user.status is ChunkPathStatus.PLANNED:
                self._unplan(user)

    # -- KV-connector scheduler hooks -------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """Register a chunk-path request; others, chunk prefills included, carry no `chunk_cache`."""
        info = getattr(request, "chunk_cache", None)
        if info is None:
            return
        private = info.recovers or bool(request.cache_salt)
        user = self.users[request.request_id] = UserRequest(request=request, info=info, private=private)
        self.recompute.attach(user)
        if info.cover and info.recovered:  # a question `cover` cannot score: every document computed
            self.manager.stats.cover_fallbacks += 1
        if user.selection is not None:
            # Its blocks are rewritten while it runs: no one, itself after a preemption included,
            # may take them as a prefix (its block keys are its own: `block_keys`).
            request.skip_reading_prefix_cache = True

    def owns(self, request: Request) -> bool:
        """A chunk-path request (registered) or a chunk prefill."""
        return request.request_id in self.users or request.request_id in self.prefills

    def private(self, request_id: str) -> bool:
        """Whether other KV connectors must never see a live request: a chunk prefill (no client
        sent it; its id names no peer), or a chunk-path request whose KV a connector keying by
        token ids would take for another's: one with a recovery mode (its KV depends on the mode;
        `qattn` rewrites it after its first step) or a `cache_salt` (tenants never share KV)."""
        user = self.users.get(request_id)
        return request_id in self.prefills or (user is not None and user.private)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Chunk tokens to count as computed (loaded), None while R waits for its chunks.

        Changes nothing: vLLM may ask again in later steps if R is not admitted.
        """
        user = self.users.get(request.request_id)
        if user is None or user.status is ChunkPathStatus.EXTERNAL:
            return 0, False  # not ours, or another connector loads it
        if num_computed_tokens >= user.info.question_start:
            return 0, False  # the prefix cache holds the whole chunk region
        if not user.ready:
            return None, False
        return user.info.question_start - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        user = self.users.get(request.request_id)
        if user is None or user.status is ChunkPathStatus.EXTERNAL:
            return
        if num_external_tokens == 0:  # the prefix cache held the chunk region: nothing to load
            self._to_loaded(user)
            return
        assert user.ready, f"{request.request_id} admitted before its chunks were resident"
        end = user.info.question_start
        start = end - num_external_tokens
        block_ids = blocks.get_block_ids()[0]
        if user.selection is not None:
            user.block_ids = list(block_ids)
        rows = [row for entry in user.entries for row in self.chunk_prefills.rows(entry)]
        slots = [slot_of(block_ids, self.block_size, t) for t in range(start, end)]
        deltas = self.layout.load_deltas(user.info)
        self._step.load(user, rows[start:end], slots, None if deltas is None else deltas[start:end])
        user.status = ChunkPathStatus.LOADING

    def build_connector_meta(self, scheduler_output) -> ChunkCacheStepMetadata:
        pieces = self.chunk_prefills.track_blocks(scheduler_output)
        self.recompute.track_blocks(scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        shifts = {  # a piece never crosses a change of shift (`Selection.cuts`)
            rid: self.layout.shift_at(user.info, user.request.num_computed_tokens)
            for rid in scheduled
            if (user := self.users.get(rid)) is not None
        }
        saves = self.chunk_prefills.saves(pieces, scheduled)
        self.manager.computed(saves.completed)
        meta = self._step.build(
            saves,
            self.manager.take_jobs(),
            {**shifts, **self.recompute.take_shifts()},
            self.recompute.take_score_specs(scheduled),
            idle=not scheduler_output.total_num_scheduled_tokens,
        )
        # The loads run in this step's forward, before any later step can reuse the rows.
        for user in self._step.loaded:
            self._to_loaded(user)
        self._step = StepBuilder()
        return meta

    def update_connector_output(self, report: ChunkCacheWorkerMetadata | None) -> None:
        """The workers' report of a step: for the tiers (fills ended, their state), and scores."""
        if report is None:
            return
        self.manager.reported(report)
        self.recompute.scored(report.scores)

    def load_elsewhere(self, request: Request, num_tokens: int) -> None:
        """Another connector loads R's first `num_tokens` tokens, its chunk region included (the
        KV a P/D prefill instance computed): → EXTERNAL, pins released, never planned."""
        user = self.users[request.request_id]
        assert num_tokens >= user.info.question_start, "the chunk region must come whole"
        assert not user.private, "a recovering or salted request is served here"
        self._unplan(user)
        user.status = ChunkPathStatus.EXTERNAL

    def admitted_elsewhere(self, num_tokens: int) -> None:
        """An EXTERNAL request was admitted with `num_tokens` tokens to load from another
        connector: counted then, not when offered (it may yet be served here)."""
        if num_tokens:
            self.manager.stats.external_loads += 1
            self.manager.stats.external_load_tokens += num_tokens

    def is_external(self, request: Request) -> bool:
        user = self.users.get(request.request_id)
        return user is not None and user.status is ChunkPathStatus.EXTERNAL

    def serve_here(self, request: Request) -> None:
        """EXTERNAL → WAITING: the other connector no longer covers R's chunk region."""
        user = self.users[request.request_id]
        if user.status is ChunkPathStatus.EXTERNAL:
            user.status = ChunkPathStatus.WAITING

    def on_preempted(self, request: Request) -> None:
        """R lost its blocks (and so its loaded chunks): it must be planned and loaded again."""
        user = self.users.get(request.request_id)
        if user is not None:
            self._unplan(user)
            if user.selection is not None:
                user.selection.restart()

    def request_finished(self, request: Request) -> None:
        prefill = self.chunk_prefills.finish(request.request_id)
        if prefill is not None:
            self._prefill_finished(prefill, request)
        user = self.users.pop(request.request_id, None)
        if user is not None:
            self.recompute.detach(request.request_id)
            self._unplan(user)

    def _prefill_finished(self, prefill: ChunkPrefill, request: Request) -> None:
        # A prefill that sampled its token computed (and captured) its whole prompt, even if it was
        # preempted (async scheduling) after its last forward was dispatched.
        if request.num_output_tokens > 0:
            for entry in prefill.entries:
                self.manager.mark_resident(entry)
            return
        logger.warning(
            "Chunk prefill %s ended early (%s); its chunks will be planned again",
            prefill.request_id,
            request.status,
        )
        for user in self.users.values():
            if user.entries is not None and any(e in user.entries for e in prefill.entries):
                self._unplan(user)
        for entry in prefill.entries:
            self.manager.discard(entry)

    def _unplan(self, user: UserRequest) -> None:
        """→ WAITING: release its pins (it is planned again at the next `plan`)."""
        if user.entries is not None:
            self.manager.release(user.entries)
        user.status, user.entries = ChunkPathStatus.WAITING, None

    def _to_loaded(self, user: UserRequest) -> None:
        self._unplan(user)
        user.status = ChunkPathStatus.LOADED

    def reset(self) -> bool:
        """Drop the pool (e.g. after a weight update): no entry that exists now is ever loaded.

        PLANNED requests are planned again; chunk prefills in flight finish into pages that are
        freed when they end (`ChunkCacheManager.clear`).
        """
        for user in self.users.values():
            if user.status is ChunkPathStatus.PLANNED:
                self._unplan(user)
        dropped = self.manager.clear()
        logger.info("Chunk Cache reset: %d pool entries dropped", dropped)
        return True
