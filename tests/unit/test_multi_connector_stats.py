"""The chunk cache statistics next to other KV connectors: the scheduler puts them under the
connector's class name among theirs (`make_stats`), and vLLM's `MultiConnector` rebuilds them
by that name in the process that logs them (the plugin registers the name).

That a second registration changes nothing is read from `KVConnectorFactory._registry`, a
private attribute: vLLM 0.23's public surface is `register_connector` (which refuses a name
already registered) and `get_connector_class_by_name` (which resolves one), and neither can tell
whether a name's loader was replaced behind them or another name added; nothing public lists the
registry. The public checks are made too."""

from __future__ import annotations

import pytest

from vllm_ascend_chunk.config.engine import CONNECTOR_MODULE
from vllm_ascend_chunk.config.engine_settings import CONNECTOR
from vllm_ascend_chunk.metrics import ChunkCacheConnectorStats, stats_payload
from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager
from vllm_ascend_chunk.vllm_adapter import plugin


def test_multi_connector_rebuilds_and_logs_the_chunk_cache_stats():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    plugin.register()
    registered = dict(KVConnectorFactory._registry)  # private: no public listing (the docstring)
    connector = KVConnectorFactory.get_connector_class_by_name(CONNECTOR)
    plugin.register()  # a process may register twice (vLLM loads plugins per process): no error, no change
    assert KVConnectorFactory._registry == registered
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR) is connector
    assert connector.__name__ == "ChunkCacheConnector" and connector.__module__ == CONNECTOR_MODULE
    with pytest.raises(ValueError, match="already registered"):
        KVConnectorFactory.register_connector(CONNECTOR, CONNECTOR_MODULE, CONNECTOR)
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
