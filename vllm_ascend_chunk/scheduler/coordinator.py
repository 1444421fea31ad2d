"""ChunkCacheCoordinator: the scheduler-side logic behind the KV connector.

Life of a chunk-path request R (`SYS + C_1..C_n + Q`):
1. `on_new_request`: R is registered; it needs a plan.
2. `plan` (start of every `schedule()`): pin the entries of SYS and every C_i; missing ones are
   created pending and one internal prefill job `SYS + C_i` is returned per missing chunk (the
   scheduler adds them as requests). R waits meanwhile: `get_num_new_matched_tokens` answers
   None ("ask again") until every entry is resident, which does not block other requests.
3. Once resident, R is admitted with `question_start - local_hit` tokens counted as computed;
   `update_state_after_alloc` turns them into a load (pool rows → R's slots), sent to the
   workers by `build_connector_meta`, after which R's pins are released.
4. Every step R computes tokens, its RoPE positions are shifted (overlap layout); in the
   sequential layout its chunk keys are re-rotated on load instead.
A job's K/V are captured into its pending entries while it computes; when the job finishes,
`request_finished` marks them resident. Preempted requests plan again.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_ascend_chunk.config import get_config
from vllm_ascend_chunk.geometry import PoolGeometry
from vllm_ascend_chunk.metadata import ChunkCacheInfo
from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager, Entry
from vllm_ascend_chunk.step import ChunkCacheStepMetadata

logger = logging.getLogger("vllm.chunk_cache")

JOB_ID_PREFIX = "chunk-cache-prefill-"


@dataclass
class ChunkJob:
    """An internal prefill `SYS + C_i` whose K/V fill pending pool entries."""

    request_id: str
    token_ids: list[int]
    capture_rows: list[int]
    """Pool row for each prompt token (-1: not stored)."""
    entries: list[Entry]
    parent: object
    """The user `Request` that caused the job (LoRA, salt, priority are taken from it)."""


@dataclass
class UserRequest:
    """A chunk-path request: UNPLANNED → PLANNED (entries pinned) → LOADED (pins released)."""

    request: object
    info: ChunkCacheInfo
    entries: list[Entry] | None = None
    """Pinned SYS entry (if any) followed by one entry per chunk, while PLANNED."""
    loaded: bool = False
    """Its chunk region is in its own blocks (loaded, or a prefix-cache hit): no pins needed."""
    local_hit: int = 0

    @property
    def needs_plan(self) -> bool:
        return self.entries is None and not self.loaded

    def needs(self) -> list[tuple[bytes, int]]:
        sys = [(self.info.sys_hash, self.info.sys_len)] if self.info.sys_len else []
        return sys + list(zip(self.info.chunk_hashes, self.info.chunk_lens, strict=True))


@dataclass
class _Step:
    loaded: list[UserRequest] = field(default_factory=list)
    load_rows: list[int] = field(default_factory=list)
    load_slots: list[int] = field(default_factory=list)
    load_deltas: list[int] = field(default_factory=list)


class ChunkCacheCoordinator:
    def __init__(self, geometry: PoolGeometry, block_size: int) -> None:
        config = get_config()
        self.geometry = geometry
        self.layout = config.layout
        self.block_size = block_size
        self.manager = ChunkCacheManager(geometry.num_pages, geometry.page_size, config.lru_threshold)
        self.users: dict[str, UserRequest] = {}
        self.jobs: dict[str, ChunkJob] = {}
        self._job_ids = itertools.count()
        self._job_id_prefix = f"{JOB_ID_PREFIX}{uuid.uuid4().hex[:8]}-"
        self._ended_jobs: set[str] = set()
        self._step = _Step()

    def take_job_ids_to_hide(self) -> set[str]:
        """Ids of jobs whose outputs must not reach clients: running ones and those just ended."""
        hidden = self._ended_jobs | self.jobs.keys()
        self._ended_jobs = set()
        return hidden

    # -- planning (called by the scheduler before each schedule) -----------------------------
    def plan(self) -> list[ChunkJob]:
        """Plan waiting requests in arrival order; stop at the first the pool cannot take yet."""
        jobs: list[ChunkJob] = []
        for user in self.users.values():
            if not user.needs_plan:
                continue
            needs = user.needs()
            acquired = self.manager.acquire(needs, chunk_keys=set(user.info.chunk_hashes))
            if acquired is None:
                break
            user.entries = acquired.entries
            jobs += self._jobs_for(user, acquired.created)
        self.manager.stats.chunk_prefills += len(jobs)
        return jobs

    def _jobs_for(self, user: UserRequest, created: Sequence[Entry]) -> list[ChunkJob]:
        info, ids = user.info, user.request.prompt_token_ids
        sys_entry = user.entries[0] if info.sys_len else None
        store_sys = sys_entry is not None and sys_entry in created
        jobs = []
        for i, entry in enumerate(user.entries[1 if info.sys_len else 0:]):
            if entry not in created or any(entry in j.entries for j in jobs):
                continue
            start, end = info.chunk_span(i)
            rows = (self._rows(sys_entry) if store_sys else [-1] * info.sys_len) + self._rows(entry)
            jobs.append(self._job(ids[:info.sys_len] + ids[start:end], rows,
                                  [sys_entry, entry] if store_sys else [entry], user))
            store_sys = False
        if store_sys:  # every chunk was resident, only SYS is missing
            jobs.append(self._job(ids[:info.sys_len], self._rows(sys_entry), [sys_entry], user))
        return jobs

    def _job(self, token_ids: list[int], rows: list[int], entries: list[Entry],
             user: UserRequest) -> ChunkJob:
        job = ChunkJob(request_id=f"{self._job_id_prefix}{next(self._job_ids)}", token_ids=list(token_ids),
                       capture_rows=rows, entries=entries, parent=user.request)
        self.jobs[job.request_id] = job
        return job

    def _rows(self, entry: Entry) -> list[int]:
        return entry.rows(self.manager.page_size)

    # -- KV-connector scheduler hooks -------------------------------------------------------
    def on_new_request(self, request) -> None:
        info = getattr(request, "chunk_cache", None)
        if info is not None and request.request_id not in self.jobs:
            self.users[request.request_id] = UserRequest(request=request, info=info)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        user = self.users.get(request.request_id)
        if user is None:
            return 0, False
        if user.loaded:  # asked again: it was preempted after its load, so it starts over
            user.loaded = False
        question_start = user.info.question_start
        if num_computed_tokens >= question_start:  # the prefix cache holds the whole chunk region
            self._done(user)
            return 0, False
        if user.entries is None or not all(e.resident for e in user.entries):
            return None, False
        user.local_hit = num_computed_tokens
        return question_start - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        user = self.users.get(request.request_id)
        if user is None or num_external_tokens == 0:
            return
        start, end = user.local_hit, user.local_hit + num_external_tokens
        assert end == user.info.question_start, "chunk loads always end at the question"
        block_ids = blocks.get_block_ids()[0]
        bs = self.block_size
        self._step.load_rows += self._source_rows(user)[start:end]
        self._step.load_slots += [block_ids[t // bs] * bs + t % bs for t in range(start, end)]
        if self.layout == "sequential":
            self._step.load_deltas += self._sequential_deltas(user.info)[start:end]
        self._step.loaded.append(user)

    def position_shift(self, info: ChunkCacheInfo) -> int:
        """RoPE shift of the question and generated tokens (overlap: chunks share positions)."""
        if self.layout != "overlap" or not info.chunk_lens:
            return 0
        return sum(info.chunk_lens) - max(info.chunk_lens)

    @staticmethod
    def _sequential_deltas(info: ChunkCacheInfo) -> list[int]:
        """RoPE delta of every token before the question: 0 for SYS, for C_i the lengths of the
        chunks before it (its cached keys were computed right after SYS)."""
        deltas, offset = [0] * info.sys_len, 0
        for n in info.chunk_lens:
            deltas += [offset] * n
            offset += n
        return deltas

    def _source_rows(self, user: UserRequest) -> list[int]:
        """Pool row of every token before the question: SYS, then each chunk."""
        return [row for entry in user.entries for row in self._rows(entry)]

    def build_connector_meta(self, scheduler_output) -> ChunkCacheStepMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        meta = ChunkCacheStepMetadata(
            load_rows=self._step.load_rows,
            load_slots=self._step.load_slots,
            load_deltas=self._step.load_deltas,
            captures={rid: self.jobs[rid].capture_rows for rid in scheduled if rid in self.jobs},
            position_shifts={rid: self.position_shift(self.users[rid].info)
                             for rid in scheduled if rid in self.users},
        )
        # The loads run in this step's forward, before any later step can reuse the rows.
        for user in self._step.loaded:
            self._done(user)
        self._step = _Step()
        return meta

    def request_finished(self, request) -> None:
        job = self.jobs.pop(request.request_id, None)
        if job is not None:
            self._ended_jobs.add(job.request_id)
            self._job_finished(job, request)
        user = self.users.pop(request.request_id, None)
        if user is not None:
            self._unplan(user)

    def _job_finished(self, job: ChunkJob, request) -> None:
        # A job that sampled its token computed (and captured) its whole prompt.
        if request.num_computed_tokens >= len(job.token_ids):
            for entry in job.entries:
                self.manager.mark_resident(entry)
            return
        logger.warning("Chunk prefill %s ended early (%s); its chunks will be planned again",
                       job.request_id, request.status)
        for user in self.users.values():
            if user.entries is not None and any(e in user.entries for e in job.entries):
                self._unplan(user)
        for entry in job.entries:
            self.manager.discard(entry)

    def _unplan(self, user: UserRequest) -> None:
        """Release the pins of a PLANNED request (it will be planned again if still waiting)."""
        if user.entries is not None:
            self.manager.release(user.entries)
            user.entries = None

    def _done(self, user: UserRequest) -> None:
        self._unplan(user)
        user.loaded = True

    def reset(self) -> bool:
        dropped = self.manager.clear()
        logger.info("Chunk Cache reset: %d pool entries dropped", dropped)
        return True
