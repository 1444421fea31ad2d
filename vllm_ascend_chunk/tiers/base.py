"""The tiers below the device pool, behind one interface (after vLLM's `OffloadingManager`).

A key missing from the pool is offered to each tier in order (`ChunkCacheManager.tiers`): the
first that has a copy fills the new entry, either with the step being built (`Fill.NOW`: the
host tier's row copies; the entry is resident at once) or by the workers from the step that
carries the read on (`Fill.LATER`: the remote store's read, which ends in whichever step its
object arrives, or as a miss `VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S` after it, without holding any
step; the entry is FETCHING until every rank's report reaches `ChunkCacheManager.fetched`). An
entry evicted from the pool is offered to every tier (`prepare_store`). What the workers must do
for a tier travels with the next step (`take_jobs`), and their report of the step comes back to
every tier (`reported`).

A new backend is one class with these methods, which the manager never names; its workers' side
is one class behind `tiers.worker_base.WorkerTier`. Besides those: the coordinator builds the
scheduler-side tiers and `ChunkCacheWorker` the workers' (an edit to each, with a setting in
`config/settings.py`); jobs other than host copies and remote reads need fields in `TierJobs`,
`core.step.ChunkCacheStepMetadata` (filled by `scheduler.step_builder`) and, for a report of
another kind, `core.step.ChunkCacheWorkerMetadata`; counters of its own go in `core/stats.py`. The
remote store's writes are planned by the chunk prefills (`ChunkPrefills.saves`), not through this
interface. `tests/helpers/memory_tier.py` needs none of these only because it is a scheduler-side
tier without K/V or workers, added to a manager by its tests (the manager's and the coordinator's
random operation tests).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from vllm_ascend_chunk.core.paging import PagedEntry

if TYPE_CHECKING:
    from vllm_ascend_chunk.core.stats import ChunkCacheStats
    from vllm_ascend_chunk.core.step import ChunkCacheWorkerMetadata, RemoteRead


class Fill(enum.Enum):
    """How a tier fills a new pool entry (`Tier.prepare_load`)."""

    ABSENT = "absent"
    """It has no copy (or cannot be reached): the next tier is asked."""
    NOW = "now"
    """By the step being built, before anything reads the entry: resident at once."""
    LATER = "later"
    """By the workers from the step that carries the job on, across as many steps as it takes
    (the remote store's read, up to the timeout): FETCHING until their reports end the fill
    (`ChunkCacheManager.fetched`); the requests that need the entry wait, no one else does."""


@dataclass
class TierJobs:
    """What the tiers ask of the next step's workers: row copies between the device pool and host
    memory (every write before every read), then reads from the remote store."""

    write_from: list[int] = field(default_factory=list)
    """Device-pool rows copied into host memory ..."""
    write_to: list[int] = field(default_factory=list)
    """... at these host rows (entries evicted from the pool)."""
    read_from: list[int] = field(default_factory=list)
    """Host rows copied into the device pool ..."""
    read_to: list[int] = field(default_factory=list)
    """... at these pool rows (entries found in the host tier)."""
    remote_reads: list[RemoteRead] = field(default_factory=list)
    """Entries the remote store fills (`Fill.LATER`), read into their pool rows."""


class Tier(Protocol):
    def hold(self, key: bytes) -> None:
        """`key` is about to be offered: keep its copy while the pool makes room (an eviction
        into this tier must not replace it)."""

    def prepare_load(self, entry: PagedEntry) -> Fill:
        """Plan filling `entry` (new, its pages taken) with this tier's copy of its key."""

    def loaded(self, entry: PagedEntry, tokens: int, ok: bool) -> None:
        """A fill of `entry` by this tier ended (`NOW`: at once, ok), to be counted as a hit of
        `tokens` chunk tokens (0: not counted)."""

    def prepare_store(self, entry: PagedEntry) -> None:
        """`entry` leaves the pool (evicted, its rows still hold its K/V this step): keep a copy
        if this tier keeps evicted entries."""

    def take_jobs(self, jobs: TierJobs) -> None:
        """The step being built is sent: add what its workers must do for this tier to `jobs`;
        from now on the copies it reads or writes may be replaced."""

    def reported(self, report: ChunkCacheWorkerMetadata) -> None:
        """The workers' report of a step: end the fills it reports (`ChunkCacheManager.fetched`)."""

    def clear(self) -> None:
        """Drop every copy (a cache reset)."""

    def gauges(self) -> dict[str, float]:
        """This tier's gauges for `metrics.stats_payload`."""


class TierOwner(Protocol):
    """What a tier that fills entries asynchronously (`Fill.LATER`) needs of the pool index that
    offers it keys (`scheduler.manager.ChunkCacheManager`)."""

    stats: ChunkCacheStats
    page_size: int

    def add_tier(self, tier: Tier) -> None:
        """Offer this tier the keys missing from the pool, after the tiers added before it."""

    def fetched(self, entry: PagedEntry, ok: bool) -> None:
        """A `Fill.LATER` fill of `entry` ended: resident if `ok`, else to be computed."""
