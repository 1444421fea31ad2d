"""The Mooncake Store tier's `Backend`: on when the engine's settings name a master
(`VLLM_CHUNK_CACHE_REMOTE_MASTER`: `config.settings.RemoteConfig`)."""

from __future__ import annotations

import logging

from vllm_ascend_chunk.tiers.base import Backend
from vllm_ascend_chunk.tiers.mooncake.jobs import NAME
from vllm_ascend_chunk.tiers.mooncake.scheduler import RemoteStoreTier

logger = logging.getLogger("vllm.chunk_cache")


def _scheduler(settings, geometry, owner, ranks) -> RemoteStoreTier | None:
    return RemoteStoreTier(owner, ranks) if settings.remote_config is not None else None


def _worker(settings, vllm_config, geometry, device):
    """This worker's client of the store (it connects in the background)."""
    if settings.remote_config is None:
        return None
    from vllm.distributed import get_pp_group, get_tp_group
    from vllm.utils.network_utils import get_ip

    from vllm_ascend_chunk.tiers.mooncake.store import RemoteStore
    from vllm_ascend_chunk.tiers.mooncake.worker import RemoteStoreWorker, ShardIdentity

    remote_config = settings.remote_config
    store = RemoteStore(remote_config, local_hostname=remote_config.local_host or get_ip())
    identity = ShardIdentity(
        model=vllm_config.model_config.model,
        layout=settings.layout,
        tp_rank=get_tp_group().rank_in_group,
        tp_size=get_tp_group().world_size,
        pp_rank=get_pp_group().rank_in_group,
        pp_size=get_pp_group().world_size,
    )
    logger.info("Chunk Cache: remote tier %s", remote_config.describe())
    return RemoteStoreWorker(store, geometry, identity)


BACKEND = Backend(
    NAME,
    _scheduler,
    _worker,
    gauges={"remote_up": "1 while the remote store is reachable (0 when it is not, or none is configured)."},
)
