"""MemoryCopies: the test-only memory tier, the workers' side (`tiers.worker_base.WorkerTier`)."""

from __future__ import annotations

import torch

from tests.helpers.memory_tier.scheduler import NAME, MemoryJobs
from vllm_ascend_chunk.core.pool import ChunkCachePool
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata
from vllm_ascend_chunk.tiers.worker_base import jobs_of


class MemoryCopies:
    name = NAME

    def __init__(self) -> None:
        self.kv: dict[bytes, torch.Tensor] = {}
        """Key → the entry's K/V rows, as the pool held them when it was evicted."""

    def start(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        jobs: MemoryJobs | None = jobs_of(self, meta)
        for key, rows in jobs.keep if jobs is not None else ():
            self.kv[key] = pool.read_rows(rows).clone()

    def save(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        pass

    def finish(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> dict[int, bool] | None:
        jobs: MemoryJobs | None = jobs_of(self, meta)
        if jobs is None or not jobs.fill:
            return None
        report = {}
        for fill_id, key, rows in jobs.fill:
            kv = self.kv.get(key)
            if kv is not None:
                pool.write_rows(rows, kv)
            report[fill_id] = kv is not None
        return report

    def close(self) -> None:
        self.kv.clear()
