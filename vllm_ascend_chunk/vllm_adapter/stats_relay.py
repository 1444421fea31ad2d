"""The chunk cache's counters in vLLM's scheduler stats: the payload goes in the slot vLLM keeps
for KV connector stats (next to other connectors, under its class name, as `MultiConnector`
keeps theirs), and is delivered only with stats a frontend records. Part of the scheduler's
vLLM adapter (`vllm_adapter.scheduler`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from vllm_ascend_chunk.vllm_adapter.connector import ChunkCacheConnector


class StatsRelay:
    """Puts `chunk_connector`'s payload into the stats of the scheduler whose connector is
    `connector` (the chunk cache itself, or a `ChunkCacheMultiConnector` holding it)."""

    def __init__(self, connector: KVConnectorBase_V1, chunk_connector: ChunkCacheConnector) -> None:
        self.chunk_connector = chunk_connector
        self.alone = connector is chunk_connector
        """The chunk cache is the engine's only KV connector."""
        self.name = type(chunk_connector).__name__

    def attach(self, stats) -> None:
        """The payload into `stats` (vLLM's `SchedulerStats`), in the serialized form
        `{"data": ...}` that `MultiConnector` rebuilds by connector name when not alone."""
        payload = self.chunk_connector.stats_payload()
        if self.alone:
            stats.kv_connector_stats = payload
        else:
            stats.kv_connector_stats = {**(stats.kv_connector_stats or {}), self.name: {"data": payload}}

    def deliver(self, outputs) -> None:
        """A payload in stats of a step with outputs is delivered (its increments are counted);
        one in stats without outputs is taken out (vLLM's offline engine drops those stats), and
        its increments wait for the next."""
        for eco in outputs.values():
            if eco.scheduler_stats is None or (payload := self._payload(eco.scheduler_stats)) is None:
                continue
            if eco.outputs:
                self.chunk_connector.stats_delivered(payload)
            elif self.alone:
                eco.scheduler_stats.kv_connector_stats = None
            else:
                del eco.scheduler_stats.kv_connector_stats[self.name]

    def _payload(self, stats) -> dict | None:
        data = stats.kv_connector_stats
        if self.alone or not data:
            return data
        return data.get(self.name, {}).get("data")
