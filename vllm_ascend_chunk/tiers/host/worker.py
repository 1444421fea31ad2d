"""HostCopies: the host-memory tier's rows, the workers' side (`tiers.worker_base.WorkerTier`).

The rows have the pool's format in host memory (pinned beside an accelerator); the scheduler's
`HostTier` says which rows hold which entry. At the start of a step, entries evicted from the
pool are copied into their host rows, then entries found in the host tier are copied into their
new pool rows: so a pool row freed and reused at once is overwritten only after its old content
was copied out.
"""

from __future__ import annotations

import torch

from vllm_ascend_chunk.core.geometry import PoolGeometry
from vllm_ascend_chunk.core.pool import ChunkCachePool
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata
from vllm_ascend_chunk.tiers.host.scheduler import NAME, HostJobs
from vllm_ascend_chunk.tiers.worker_base import jobs_of


class HostCopies:
    name = NAME

    def __init__(self, geometry: PoolGeometry, device: torch.device) -> None:
        """`device`: the pool's (host rows are pinned unless it is the CPU)."""
        g = geometry
        shape = (g.num_layers, 2, g.num_host_pages * g.page_size, g.num_kv_heads, g.head_size)
        self.kv = torch.zeros(shape, dtype=g.dtype, pin_memory=device.type != "cpu")

    def to_host(self, pool: ChunkCachePool, rows: list[int], host_rows: list[int]) -> None:
        """Copy pool `rows` into the host tier at `host_rows`."""
        self.kv.index_copy_(2, torch.tensor(host_rows, dtype=torch.int64), pool.read_rows(rows))

    def from_host(self, pool: ChunkCachePool, host_rows: list[int], rows: list[int]) -> None:
        """Copy host-tier `host_rows` into the pool at `rows`."""
        pool.write_rows(rows, self.kv.index_select(2, torch.tensor(host_rows, dtype=torch.int64)))

    def start(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        jobs: HostJobs | None = jobs_of(self, meta)
        if jobs is None:
            return
        if jobs.write_from:
            self.to_host(pool, jobs.write_from, jobs.write_to)
        if jobs.read_from:
            self.from_host(pool, jobs.read_from, jobs.read_to)

    def save(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        pass

    def finish(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        return None

    def close(self) -> None:
        pass
