"""The tiers below the device pool, behind one interface (after vLLM's `OffloadingManager`).

A key missing from the pool is offered to each tier in order (`ChunkCacheManager.tiers`): the
first that has a copy fills the new entry, either with the step being built (`Fill.NOW`: the
host tier's row copies; the entry is resident at once) or by the workers from the step that
carries the read on (`Fill.LATER`: the remote store's read, which ends in whichever step its
object arrives, or as a miss `VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S` after it, without holding any
step; the entry is FETCHING until every rank's report reaches `ChunkCacheManager.fetched`). An
entry computed by a chunk prefill, and one evicted from the pool, is offered to every tier
(`prepare_store`). What the workers must do for a tier travels with the next step (`take_jobs`),
and their reports come back to it (`reported`).

A backend is one folder: its scheduler-side class behind `Tier`, its workers' class behind
`tiers.worker_base.WorkerTier`, and a `tiers.registry.Backend` that builds both from the engine's
settings; one line in `tiers.registry.BACKENDS` registers it. The manager, the coordinator, the
worker, the step contract and the metrics name no backend: jobs and reports are the tier's own
values under its `name` (`core.step`), its gauges are declared by its `Backend`. A tier's
counters are fields of `core.stats.ChunkCacheStats` (the public metric names), which it updates.
`tests/helpers/memory_tier/` is a third backend, registered by the tests that use it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from vllm_ascend_chunk.core.paging import PagedEntry

if TYPE_CHECKING:
    import torch

    from vllm_ascend_chunk.config.settings import ChunkCacheConfig
    from vllm_ascend_chunk.core.geometry import PoolGeometry
    from vllm_ascend_chunk.core.stats import ChunkCacheStats
    from vllm_ascend_chunk.tiers.worker_base import WorkerTier


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


class Kept(enum.Enum):
    """Why a tier is offered an entry to keep (`Tier.prepare_store`)."""

    COMPUTED = "computed"
    """A chunk prefill completed it this step: its rows hold its K/V after the step's saves."""
    EVICTED = "evicted"
    """It leaves the pool: its rows still hold its K/V this step."""


class Tier(Protocol):
    name: str
    """The key of its jobs in the step and of its workers' reports (`core.step`)."""

    def hold(self, key: bytes) -> None:
        """`key` is about to be offered: keep its copy while the pool makes room (an eviction
        into this tier must not replace it), until the step is sent; nothing else changes (the
        pool may not make room, and the key is then not offered)."""

    def prepare_load(self, entry: PagedEntry) -> Fill:
        """Plan filling `entry` (new, its pages taken) with this tier's copy of its key (a hit:
        the copy is used, e.g. most recently used in the host tier's LRU order)."""

    def loaded(self, entry: PagedEntry, tokens: int, ok: bool) -> None:
        """A fill of `entry` by this tier ended (`NOW`: at once, ok), to be counted as a hit of
        `tokens` chunk tokens (0: not counted)."""

    def prepare_store(self, entry: PagedEntry, why: Kept) -> None:
        """`entry`'s K/V is in its rows this step (`why`): plan keeping a copy, if this tier keeps
        such entries (the host tier: evicted ones; the remote store: computed ones)."""

    def take_jobs(self) -> Any:
        """The step being built is sent: what its workers must do for this tier (None: nothing);
        from now on the copies it reads or writes may be replaced."""

    def reported(self, reports: dict[int, Any]) -> None:
        """Its workers' reports of a step, by rank (`WorkerTier.finish`): end the fills they
        report (`ChunkCacheManager.fetched`)."""

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


@dataclass(frozen=True)
class Backend:
    """One tier backend: what builds its two sides (`tiers.registry.BACKENDS` lists them)."""

    name: str
    scheduler: Callable[[ChunkCacheConfig, PoolGeometry, TierOwner, int], Tier | None]
    """(settings, geometry, the pool index, the engine's worker ranks) → its scheduler side, or
    None when the settings do not ask for it."""
    worker: Callable[[ChunkCacheConfig, Any, PoolGeometry, torch.device], WorkerTier | None]
    """(settings, vLLM config, the stage's geometry, the pool's device) → its workers' side, or
    None when the settings do not ask for it."""
    gauges: dict[str, str] = field(default_factory=dict)
    """Its gauges (`Tier.gauges`) → Prometheus help text; an engine without it reports 0."""
