"""The tiers below the device pool, the workers' side: each tier one `WorkerTier`.

`ChunkCacheWorker` runs its tiers in order (the host copies, then the remote store) at three
points of every step: `start` before the forward and before any load from the pool, `save` after
the forward once the pool holds what the step computed, and `finish` at the step's end (with or
without a forward), whose reports go back to the scheduler's side of the tiers
(`tiers.base.Tier.reported`). A new
backend is one class with these methods beside its scheduler-side class, and an edit to
`ChunkCacheWorker.register_kv_caches`, which builds them (`tiers.base` says what else it needs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vllm_ascend_chunk.core.pool import ChunkCachePool
    from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata, ChunkCacheWorkerMetadata


class WorkerTier(Protocol):
    def start(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        """Before the forward: this tier's jobs of the step (copies done before the pool's loads;
        asynchronous fills started)."""

    def save(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        """After the forward and the pool's saves: keep what the step asks this tier to keep."""

    def finish(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> ChunkCacheWorkerMetadata | None:
        """The step's end: the fills that ended since the last step written into the pool; what
        the scheduler must know (None: nothing new). A fill may outlast the step that started it:
        only an idle step (`meta.idle`) may wait for one, briefly."""

    def close(self) -> None:
        """The worker shuts down."""
