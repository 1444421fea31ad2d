"""The tiers below the device pool, the workers' side: each tier one `WorkerTier`.

`ChunkCacheWorker` runs its tiers in order (the order of `tiers.registry.BACKENDS`) at three
points of every step: `start` before the forward and before any load from the pool, `save` after
the forward once the pool holds what the step computed, and `finish` at the step's end (with or
without a forward), whose reports go back to the scheduler's side of the tier
(`tiers.base.Tier.reported`). Each reads its own jobs of the step (`jobs_of`). A backend's
`tiers.registry.Backend` builds its `WorkerTier`; the worker never names one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm_ascend_chunk.core.pool import ChunkCachePool
    from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata


class WorkerTier(Protocol):
    name: str
    """Its scheduler side's `Tier.name`: the key of its jobs and reports."""

    def start(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        """Before the forward: this tier's jobs of the step (copies done before the pool's loads;
        asynchronous fills started)."""

    def save(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        """After the forward and the pool's saves: keep what the step asks this tier to keep."""

    def finish(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> Any:
        """The step's end: the fills that ended since the last step written into the pool; this
        rank's report to the scheduler (None: nothing new). A fill may outlast the step that
        started it: only an idle step (`meta.idle`) may wait for one, briefly."""

    def close(self) -> None:
        """The worker shuts down."""


def jobs_of(tier: WorkerTier, meta: ChunkCacheStepMetadata) -> Any:
    """`tier`'s jobs in the step `meta` (None: none)."""
    return meta.tier_jobs.get(tier.name)
