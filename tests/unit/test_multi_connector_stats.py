"""The chunk cache statistics next to other KV connectors: the scheduler puts them under the
connector's class name among theirs (`make_stats`), and vLLM's `MultiConnector` rebuilds them
by that name in the process that logs them (the plugin registers the name)."""

from __future__ import annotations

from vllm_ascend_chunk.metrics import ChunkCacheConnectorStats, stats_payload
from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager
from vllm_ascend_chunk.vllm_adapter import plugin


def test_multi_connector_rebuilds_and_logs_the_chunk_cache_stats():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    plugin.register()
    registered = dict(KVConnectorFactory._registry)
    plugin.register()  # a process may register twice (vLLM loads plugins per process): no error, no change
    assert KVConnectorFactory._registry == registered
    assert (
        KVConnectorFactory.get_connector_class_by_name("ChunkCacheConnector").__name__
        == "ChunkCacheConnector"
    )
    manager = ChunkCacheManager(4, 16, 1.0)
    manager.stats.hits, manager.stats.misses = 3, 1
    # As serialized between the engine core and the frontend: {"data": ...} per connector.
    data = {"ChunkCacheConnector": {"data": stats_payload(manager)}, "OffloadingConnector": {"data": {}}}
    stats = MultiConnector.build_kv_connector_stats(data)
    assert isinstance(stats["ChunkCacheConnector"], ChunkCacheConnectorStats)
    assert isinstance(stats["OffloadingConnector"], OffloadingConnectorStats)
    assert not stats.is_empty()
    reduced = stats.reduce()["ChunkCacheConnector"]
    assert (reduced["chunk_hits"], reduced["chunk_misses"], reduced["chunk_hit_rate"]) == (3, 1, "75.0%")
