"""ChunkCacheCoordinator: the scheduler-side logic behind the KV connector.

Life of a chunk-path request R (`SYS + C_1..C_n + Q`), as `UserStatus` transitions:
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
5. The layout (`layouts.py`) places R's tokens: every step R computes tokens, their RoPE
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
come back with the step's report.
A prefill's tokens are copied from its paged-cache slots into its pending entries after each step
that computes them (`save_rows`/`save_slots`); when the prefill has sampled its token (its whole
prompt was computed and saved), `request_finished` marks them resident.

Tiers: the manager plans the copies between the pool and the host tier (sent with the step), and
which missing entries are read from the remote store instead of computed. A read is sent with
the step and reported by the workers at its end (`update_connector_output`): the entry becomes
resident, or a chunk prefill computes it. Every entry a chunk prefill computed is written to the
remote store after the step that saved its last tokens.
"""

from __future__ import annotations

import enum
import itertools
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_ascend_chunk.config import get_config
from vllm_ascend_chunk.geometry import PoolGeometry
from vllm_ascend_chunk.layouts import LAYOUTS
from vllm_ascend_chunk.metadata import ChunkCacheInfo
from vllm_ascend_chunk.paging import slot_of
from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager, Entry
from vllm_ascend_chunk.scheduler.selection import Phase, Selection
from vllm_ascend_chunk.step import (
    ChunkCacheStepMetadata,
    ChunkCacheWorkerMetadata,
    RemoteRead,
    RemoteWrite,
    ScoreSpec,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.chunk_cache")

CHUNK_PREFILL_ID_PREFIX = "chunk-cache-prefill-"


def is_chunk_prefill(request_id: str) -> bool:
    """Whether `request_id` names a chunk prefill (every process can tell by the id alone)."""
    return request_id.startswith(CHUNK_PREFILL_ID_PREFIX)


@dataclass
class ChunkPrefill:
    """A chunk prefill: a hidden request computing `SYS + C_i` whose K/V fill pending pool entries."""

    request_id: str
    token_ids: list[int]
    pool_rows: list[int]
    """Pool row for each prompt token (-1: not stored)."""
    entries: list[Entry]
    parent: Request
    """The user `Request` that caused the prefill (LoRA, salt, priority are taken from it)."""
    block_ids: list[int] = field(default_factory=list)
    """Its paged-cache blocks, as the scheduler outputs announce them."""


class UserStatus(enum.Enum):
    """Where a chunk-path request stands with its chunks (transitions: `ChunkCacheCoordinator`)."""

    WAITING = "waiting"
    """Needs a plan; holds no pins (new, preempted after its load, or unplanned)."""
    PLANNED = "planned"
    """Its SYS and chunk entries are pinned; it waits until every one is resident."""
    LOADING = "loading"
    """Admitted this step: its load is in the step being built; pins held until it is sent."""
    LOADED = "loaded"
    """Its chunk region is in its own blocks (loaded, or a prefix-cache hit); no pins."""
    EXTERNAL = "external"
    """Another connector loads its KV, chunk region included (P/D decode instance); no pins."""


@dataclass
class UserRequest:
    """A chunk-path request and its chunk-cache state."""

    request: Request
    info: ChunkCacheInfo
    status: UserStatus = UserStatus.WAITING
    entries: list[Entry] | None = None
    """Pinned SYS entry (if any) followed by one entry per chunk, while PLANNED or LOADING."""
    counted: bool = False
    """Its chunks have been counted in the hit/miss statistics (once per request)."""
    selection: Selection | None = None
    """Its `qattn` passes (None: it recomputes nothing in place)."""
    block_ids: list[int] = field(default_factory=list)
    """Its paged-cache blocks, tracked while it has a selection (the scores read its keys)."""
    private: bool = False
    """Other KV connectors never see it (`ChunkCacheCoordinator.private`)."""

    def needs(self) -> list[tuple[bytes, int]]:
        sys = [(self.info.sys_hash, self.info.sys_len)] if self.info.sys_len else []
        return sys + list(zip(self.info.chunk_hashes, self.info.chunk_lens, strict=True))

    @property
    def ready(self) -> bool:
        """PLANNED and every entry resident: it can be admitted with its chunks loaded."""
        return self.status is UserStatus.PLANNED and all(e.resident for e in self.entries)


@dataclass
class _Step:
    loaded: list[UserRequest] = field(default_factory=list)
    load_rows: list[int] = field(default_factory=list)
    load_slots: list[int] = field(default_factory=list)
    load_deltas: list[int] = field(default_factory=list)
    remote_reads: list[RemoteRead] = field(default_factory=list)
    shadow_shifts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ShadowRun:
    """A `qattn` run computed as a batch row of its own, beside its request's piece: the
    request's tokens and blocks, computed from `start` to `end` (`ChunkCacheCoordinator.shadow_runs`)."""

    request_id: str
    parent: Request
    start: int
    end: int


class ChunkCacheCoordinator:
    def __init__(
        self, geometry: PoolGeometry, block_size: int, priority_order: bool = False, has_remote: bool = False
    ) -> None:
        config = get_config()
        self.geometry = geometry
        self.layout = LAYOUTS[config.layout]
        self.block_size = block_size
        self.priority_order = priority_order
        """Plan in (priority, arrival) order, as vLLM's `--scheduling-policy priority` schedules."""
        self.manager = ChunkCacheManager(
            geometry.num_pages,
            geometry.page_size,
            config.lru_threshold,
            host_pages=geometry.num_host_pages,
            token_bytes=geometry.bytes_per_token,
        )
        self.has_remote = has_remote
        """A remote store is configured: computed entries are written to it, missing ones read."""
        self.manager.remote_reachable = has_remote
        self.reads: dict[int, Entry] = {}
        """Remote reads sent to the workers and not reported yet, by `RemoteRead.read_id`."""
        self._read_ids = itertools.count()
        self.unread: list[Entry] = []
        """Entries whose remote read failed and that a request still holds: computed from the
        next `plan`."""
        self.remote_counters: dict[int, dict[str, int]] = {}
        """Latest remote-store counters of each worker."""
        self.remote_up: dict[int, bool] = {}
        """Latest remote-store state of each worker: a rank's report counts until it reports
        again (a worker reports only changes); the store is up only if every rank says so."""
        self.users: dict[str, UserRequest] = {}
        self.prefills: dict[str, ChunkPrefill] = {}
        self._prefill_counter = itertools.count()
        self._id_prefix = f"{CHUNK_PREFILL_ID_PREFIX}{uuid.uuid4().hex[:8]}-"
        self._ended_prefills: set[str] = set()
        self._blocked: str | None = None
        """The request the pool could not take at the last `plan`, if any."""
        self._step = _Step()

    def take_prefill_ids_to_hide(self) -> set[str]:
        """Ids of chunk prefills whose outputs must not reach clients: running, or just ended."""
        hidden = self._ended_prefills | self.prefills.keys()
        self._ended_prefills = set()
        return hidden

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
        prefills = self._recompute_unread()
        self._blocked = None
        for user in order:
            if user.status is not UserStatus.WAITING:
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
            user.status, user.entries, user.counted = UserStatus.PLANNED, acquired.entries, True
            prefills += self._prefills_for(user, acquired.created)
            for entry in acquired.fetches:
                read = RemoteRead(read_id=next(self._read_ids), key=entry.key, rows=self._rows(entry))
                self.reads[read.read_id] = entry
                self._step.remote_reads.append(read)
        self.manager.stats.chunk_prefills += len(prefills)
        return prefills

    def _recompute_unread(self) -> list[ChunkPrefill]:
        """Chunk prefills for the entries whose remote read failed."""
        prefills = []
        for entry in self.unread:
            holder = next((u for u in self.users.values() if u.entries and entry in u.entries), None)
            if holder is None:  # its requests left (or were unplanned) since the read failed
                self.manager.discard(entry)
            else:
                prefills += self._prefills_for(holder, [entry])
        self.unread = []
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
            if user.status is UserStatus.PLANNED:
                self._unplan(user)

    def _prefills_for(self, user: UserRequest, created: Sequence[Entry]) -> list[ChunkPrefill]:
        info, ids = user.info, user.request.prompt_token_ids
        sys_entry = user.entries[0] if info.sys_len else None
        store_sys = sys_entry is not None and sys_entry in created
        prefills = []
        for i, entry in enumerate(user.entries[1 if info.sys_len else 0 :]):
            if entry not in created or any(entry in p.entries for p in prefills):
                continue
            start, end = info.chunk_span(i)
            rows = (self._rows(sys_entry) if store_sys else [-1] * info.sys_len) + self._rows(entry)
            prefills.append(
                self._new_prefill(
                    ids[: info.sys_len] + ids[start:end],
                    rows,
                    [sys_entry, entry] if store_sys else [entry],
                    user,
                )
            )
            store_sys = False
        if store_sys:  # every chunk was resident, only SYS is missing
            prefills.append(self._new_prefill(ids[: info.sys_len], self._rows(sys_entry), [sys_entry], user))
        return prefills

    def _new_prefill(
        self, token_ids: list[int], rows: list[int], entries: list[Entry], user: UserRequest
    ) -> ChunkPrefill:
        prefill = ChunkPrefill(
            request_id=f"{self._id_prefix}{next(self._prefill_counter)}",
            token_ids=list(token_ids),
            pool_rows=rows,
            entries=entries,
            parent=user.request,
        )
        self.prefills[prefill.request_id] = prefill
        return prefill

    def _rows(self, entry: Entry) -> list[int]:
        return entry.rows(self.manager.page_size)

    # -- KV-connector scheduler hooks -------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """Register a chunk-path request; others, chunk prefills included, carry no `chunk_cache`."""
        info = getattr(request, "chunk_cache", None)
        if info is None:
            return
        private = info.recovers or bool(request.cache_salt)
        user = self.users[request.request_id] = UserRequest(request=request, info=info, private=private)
        user.selection = self._selection(info)
        if info.cover and info.recovered:  # a question `cover` cannot score: every document computed
            self.manager.stats.cover_fallbacks += 1
        if user.selection is not None:
            # Its blocks are rewritten while it runs: no one, itself after a preemption included,
            # may take them as a prefix (its block keys are its own: `block_keys`).
            request.skip_reading_prefix_cache = True

    def _selection(self, info: ChunkCacheInfo) -> Selection | None:
        """The `qattn` (or `cover`) passes of a request, if it may recompute anything in place."""
        if not (info.select or info.cover):
            return None
        cuts = self.layout.shift_bounds(info)
        return Selection.for_spans(info, info.select, info.select_runs, cuts, info.cover, info.cover_floor)

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
        if user is None or user.status is UserStatus.EXTERNAL:
            return 0, False  # not ours, or another connector loads it
        if num_computed_tokens >= user.info.question_start:
            return 0, False  # the prefix cache holds the whole chunk region
        if not user.ready:
            return None, False
        return user.info.question_start - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        user = self.users.get(request.request_id)
        if user is None or user.status is UserStatus.EXTERNAL:
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
        self._step.load_rows += self._source_rows(user)[start:end]
        self._step.load_slots += [slot_of(block_ids, self.block_size, t) for t in range(start, end)]
        if (deltas := self.layout.load_deltas(user.info)) is not None:
            self._step.load_deltas += deltas[start:end]
        user.status = UserStatus.LOADING
        self._step.loaded.append(user)

    def _source_rows(self, user: UserRequest) -> list[int]:
        """Pool row of every token before the question: SYS, then each chunk."""
        return [row for entry in user.entries for row in self._rows(entry)]

    def _prefill_pieces(self, scheduler_output) -> dict[str, int]:
        """Prefills scheduled this step → their first token computed in it; tracks their blocks."""
        pieces = {}
        for new in scheduler_output.scheduled_new_reqs:
            if (prefill := self.prefills.get(new.req_id)) is not None:
                prefill.block_ids = list(new.block_ids[0])
                pieces[prefill.request_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new_blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            if (prefill := self.prefills.get(rid)) is None:
                continue
            if rid in cached.resumed_req_ids:  # preempted, then given blocks anew
                prefill.block_ids = []
            prefill.block_ids += new_blocks[0] if new_blocks else []
            pieces[rid] = computed
        return pieces

    def _saves(self, scheduler_output) -> tuple[list[int], list[int], list[RemoteWrite]]:
        """Pool row and paged-cache slot of every stored chunk-prefill token computed this step,
        and the remote writes of the entries whose last tokens these are."""
        rows, slots, writes = [], [], []
        for rid, first in self._prefill_pieces(scheduler_output).items():
            prefill = self.prefills[rid]
            end = first + scheduler_output.num_scheduled_tokens[rid]
            for t in range(first, end):
                if prefill.pool_rows[t] >= 0:
                    rows.append(prefill.pool_rows[t])
                    slots.append(slot_of(prefill.block_ids, self.block_size, t))
            if self.has_remote and end == len(prefill.token_ids):
                # An entry dropped by a reset may hold K/V of replaced weights: not shared.
                writes += [RemoteWrite(e.key, self._rows(e)) for e in prefill.entries if not e.dropped]
        return rows, slots, writes

    def build_connector_meta(self, scheduler_output) -> ChunkCacheStepMetadata:
        save_rows, save_slots, writes = self._saves(scheduler_output)
        moves = self.manager.take_moves()
        meta = ChunkCacheStepMetadata(
            load_rows=self._step.load_rows,
            load_slots=self._step.load_slots,
            load_deltas=self._step.load_deltas,
            save_rows=save_rows,
            save_slots=save_slots,
            host_write_from=moves.write_from,
            host_write_to=moves.write_to,
            host_read_from=moves.read_from,
            host_read_to=moves.read_to,
            remote_reads=self._step.remote_reads,
            remote_writes=writes,
            position_shifts={  # a piece never crosses a change of shift (`Selection.cuts`)
                **{
                    rid: self.layout.shift_at(user.info, user.request.num_computed_tokens)
                    for rid in scheduler_output.num_scheduled_tokens
                    if (user := self.users.get(rid)) is not None
                },
                **self._step.shadow_shifts,
            },
            scores=self._scores(scheduler_output),
        )
        # The loads run in this step's forward, before any later step can reuse the rows.
        for user in self._step.loaded:
            self._to_loaded(user)
        self._step = _Step()
        return meta

    def _scores(self, scheduler_output) -> dict[str, ScoreSpec]:
        """The question pieces of `qattn` requests the workers score this step."""
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            user = self.users.get(rid)
            if user is None or user.selection is None or not new_blocks:
                continue
            if rid in cached.resumed_req_ids:  # preempted, then given blocks anew: all of them
                user.block_ids = list(new_blocks[0])
            else:
                user.block_ids += new_blocks[0]
        specs = {}
        for rid, num in scheduler_output.num_scheduled_tokens.items():
            user = self.users.get(rid)
            if user is None or user.selection is None:
                continue
            first = user.request.num_computed_tokens
            if user.selection.scheduled(first, num):
                slots = [slot_of(user.block_ids, self.block_size, t) for t in range(first + num)]
                region = (user.info.sys_len, user.info.question_start)
                specs[rid] = ScoreSpec(first=first, key_slots=slots, region=region)
        return specs

    def token_cap(self, request: Request, num_new_tokens: int, num_computed_tokens: int) -> int:
        """How many of `num_new_tokens` the request may compute from `num_computed_tokens` on."""
        user = self.users.get(request.request_id)
        if user is None or user.selection is None:
            return num_new_tokens
        return user.selection.cap(num_computed_tokens, num_new_tokens)

    def shadow_runs(self, num_scheduled_tokens: dict[str, int], budget: int, rows: int) -> list[ShadowRun]:
        """After vLLM scheduled this step: the further runs of `qattn` requests that are computed
        in it as rows of their own (`Selection.take`), within `budget` tokens and `rows` rows."""
        shadows = []
        for rid, num in list(num_scheduled_tokens.items()):
            user = self.users.get(rid)
            if user is None or user.selection is None:
                continue
            for start, end in user.selection.take(user.request.num_computed_tokens + num, budget, rows):
                shadow = ShadowRun(f"{rid}#run{start}", user.request, start, end)
                self._step.shadow_shifts[shadow.request_id] = self.layout.shift_at(user.info, start)
                shadows.append(shadow)
                self.manager.stats.batched_runs += 1
                budget, rows = budget - (end - start), rows - 1
        return shadows

    def reposition(self, running: Sequence[Request]) -> None:
        """Start of a schedule: move running `qattn` requests to the span they compute next."""
        for request in running:
            user = self.users.get(request.request_id)
            if user is None or user.selection is None:
                continue
            start = user.selection.reposition(request.num_computed_tokens)
            if start is not None:
                request.num_computed_tokens = start
                if user.selection.cursor == 0:
                    self.manager.stats.selections += 1
                    self.manager.stats.selected_tokens += user.selection.recomputed

    def update_connector_output(self, report: ChunkCacheWorkerMetadata | None) -> None:
        """The workers' report of a step: remote reads ended, the store's state and counters."""
        if report is None:
            return
        if report.remote_up and self.has_remote:
            self.remote_up.update(report.remote_up)
            up = all(self.remote_up.values())
            if up != self.manager.remote_reachable:
                logger.info(
                    "Chunk Cache: remote store %s",
                    "reachable: missing entries are read from it again"
                    if up
                    else "unreachable: missing entries are computed until it is back",
                )
                self.manager.remote_reachable = up
        if report.remote_counters:
            self.remote_counters.update(report.remote_counters)
            self.manager.stats.sum_remote_counters(self.remote_counters.values())
        for read_id, ok in report.reads.items():
            entry = self.reads.pop(read_id)
            if self.manager.fetched(entry, ok):
                self.unread.append(entry)
        for rid, scores in report.scores.items():
            user = self.users.get(rid)
            if user is not None and user.selection is not None and user.selection.pending:
                user.selection.reported(scores)
                if scores is None:
                    served = "every document computed" if user.selection.target else "without recompute"
                    logger.warning("Chunk Cache: %s could not be scored; served with %s", rid, served)
                if user.selection.phase is not Phase.AWAITING:
                    self._count_cover(user.selection)

    def _count_cover(self, selection: Selection) -> None:
        """A request's selection was just made: a `cover` request's coverage and fallback."""
        stats = self.manager.stats
        if selection.cover is not None:
            stats.coverage.append(selection.cover.coverage)
        stats.cover_fallbacks += selection.fell_back

    def load_elsewhere(self, request: Request, num_tokens: int) -> None:
        """Another connector loads R's first `num_tokens` tokens, its chunk region included (the
        KV a P/D prefill instance computed): → EXTERNAL, pins released, never planned."""
        user = self.users[request.request_id]
        assert num_tokens >= user.info.question_start, "the chunk region must come whole"
        assert not user.private, "a recovering or salted request is served here"
        self._unplan(user)
        user.status = UserStatus.EXTERNAL

    def admitted_elsewhere(self, num_tokens: int) -> None:
        """An EXTERNAL request was admitted with `num_tokens` tokens to load from another
        connector: counted then, not when offered (it may yet be served here)."""
        if num_tokens:
            self.manager.stats.external_loads += 1
            self.manager.stats.external_load_tokens += num_tokens

    def is_external(self, request: Request) -> bool:
        user = self.users.get(request.request_id)
        return user is not None and user.status is UserStatus.EXTERNAL

    def serve_here(self, request: Request) -> None:
        """EXTERNAL → WAITING: the other connector no longer covers R's chunk region."""
        user = self.users[request.request_id]
        if user.status is UserStatus.EXTERNAL:
            user.status = UserStatus.WAITING

    def on_preempted(self, request: Request) -> None:
        """R lost its blocks (and so its loaded chunks): it must be planned and loaded again."""
        user = self.users.get(request.request_id)
        if user is not None:
            self._unplan(user)
            if user.selection is not None:
                user.selection.restart()

    def request_finished(self, request: Request) -> None:
        prefill = self.prefills.pop(request.request_id, None)
        if prefill is not None:
            self._ended_prefills.add(prefill.request_id)
            self._prefill_finished(prefill, request)
        user = self.users.pop(request.request_id, None)
        if user is not None:
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
        user.status, user.entries = UserStatus.WAITING, None

    def _to_loaded(self, user: UserRequest) -> None:
        self._unplan(user)
        user.status = UserStatus.LOADED

    def reset(self) -> bool:
        """Drop the pool (e.g. after a weight update): no entry that exists now is ever loaded.

        PLANNED requests are planned again; chunk prefills in flight finish into pages that are
        freed when they end (`ChunkCacheManager.clear`).
        """
        for user in self.users.values():
            if user.status is UserStatus.PLANNED:
                self._unplan(user)
        dropped = self.manager.clear()
        logger.info("Chunk Cache reset: %d pool entries dropped", dropped)
        return True
