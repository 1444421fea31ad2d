"""A tier backend is one folder and one registration: the test-only memory tier
(`tests/helpers/memory_tier/`), registered for one test, is built by the same factory as the
package's backends, on the scheduler's side and the workers', and its K/V travels through the
step metadata and the workers' reports without any package module naming it."""

from __future__ import annotations

import dataclasses

import torch

from tests.helpers.memory_tier import MEMORY, registered
from tests.unit.test_pool import CPU, geometry, paged, random_rows
from vllm_ascend_chunk.config.settings import ChunkCacheConfig
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata, ChunkCacheWorkerMetadata
from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager
from vllm_ascend_chunk.tiers import registry


def test_a_registered_backend_is_built_by_the_factory_and_fills_entries_through_the_step():
    geo = dataclasses.replace(geometry(host_pages=0), num_pages=2)
    pool = paged(geo).pool
    settings = ChunkCacheConfig()
    with registered():
        manager = ChunkCacheManager(geo.num_pages, geo.page_size, 1.0)
        registry.build_tiers(settings, geo, manager, ranks=1)
        (worker,) = registry.build_worker_tiers(settings, None, geo, CPU)
        assert registry.tier_gauges().keys() >= MEMORY.gauges.keys()
    (tier,) = manager.tiers
    assert tier.name == worker.name == MEMORY.name and MEMORY not in registry.BACKENDS

    def step(idle: bool = False) -> ChunkCacheStepMetadata:
        meta = ChunkCacheStepMetadata(tier_jobs=manager.take_jobs(), idle=idle)
        worker.start(meta, pool)
        report = worker.finish(meta, pool)
        if report is not None:
            manager.reported(ChunkCacheWorkerMetadata(tiers={worker.name: {0: report}}))
        return meta

    def resident(key: bytes):
        entry = manager.acquire([(key, 16)], chunk_keys={key}).entries[0]
        manager.mark_resident(entry)
        manager.release([entry])
        return entry

    a = resident(b"a")
    kv = random_rows(pool, 16, seed=1)
    pool.write_rows(a.rows(geo.page_size), kv)
    resident(b"b")
    resident(b"c")  # a leaves the pool: the memory tier keeps its rows, copied out next step
    step()
    pool.write_rows(list(range(2 * geo.page_size)), torch.zeros_like(random_rows(pool, 32, seed=0)))
    got = manager.acquire([(b"a", 16)], chunk_keys={b"a"})
    (entry,) = got.entries
    assert got.fetches == [entry] and entry.fetching
    step(idle=True)  # the workers fill it at the step's end and report it: resident
    assert entry.resident and torch.equal(pool.read_rows(entry.rows(geo.page_size)), kv)
    assert (tier.hits, tier.hit_tokens, tier.failures) == (1, 16, 0)
