"""One engine's settings, recorded once in its `VllmConfig`: what every process of the engine reads.

`config.engine.configure` builds them from the environment's (`settings.get_config`) and what it
decides for the engine (its layout; its pool, when `VLLM_CHUNK_CACHE_SIZE_GB` sets the size) and
records them in the engine's KV transfer config, which vLLM hands to the engine core and every
worker (a `MultiConnector` child gets a copy in its own config). An auto-sized pool is recorded
where the engine core sizes it (`config.engine.carve_out_pool`), in its workers' configs (an RPC)
and in the frontend's (the engine's ready response). The frontend, the engine core and the workers
read them with `engine_settings(vllm_config)`: no process reads the environment for them again,
and two engines of one process never share them.
"""

from __future__ import annotations

import dataclasses

from vllm_ascend_chunk.config.settings import ChunkCacheConfig
from vllm_ascend_chunk.core.geometry import PoolGeometry

CONNECTOR = "ChunkCacheConnector"
MULTI_CONNECTOR = "ChunkCacheMultiConnector"
SETTINGS_KEY = "chunk_cache_settings"
"""Where an engine's config records its settings (`kv_connector_extra_config`)."""


def recorded_settings(vllm_config) -> ChunkCacheConfig | None:
    """The settings recorded in this engine's config, if any (none: the chunk cache is off)."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    return None if kv is None else (kv.kv_connector_extra_config or {}).get(SETTINGS_KEY)


def engine_settings(vllm_config) -> ChunkCacheConfig:
    """This engine's settings (`config.engine.configure` recorded them)."""
    settings = recorded_settings(vllm_config)
    if settings is None:
        raise RuntimeError("this engine does not run the Chunk Cache: config.engine.configure set none up")
    return settings


def is_active(vllm_config) -> bool:
    """Whether this engine runs the chunk cache: `configure` made `ChunkCacheConnector` its KV
    connector or a child of it and recorded its settings (never the case when the switch is off
    or the model is not applicable)."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    return (
        kv is not None
        and kv.kv_connector in (CONNECTOR, MULTI_CONNECTOR)
        and recorded_settings(vllm_config) is not None
    )


def record_settings(vllm_config, settings: ChunkCacheConfig) -> None:
    """Record `settings` in this engine's KV transfer config, and in the chunk cache's own child
    config under `ChunkCacheMultiConnector` (each child is built from its own)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra[SETTINGS_KEY] = settings
    for child in extra.get("connectors", []):
        if child.get("kv_connector") == CONNECTOR:
            child.setdefault("kv_connector_extra_config", {})[SETTINGS_KEY] = settings


def record_pool(vllm_config, pool: PoolGeometry) -> None:
    """This engine's settings with its pool, once it is sized."""
    record_settings(vllm_config, dataclasses.replace(engine_settings(vllm_config), pool=pool))


def pool_geometry(vllm_config) -> PoolGeometry:
    """The pool of this engine (recorded where its size was decided)."""
    pool = engine_settings(vllm_config).pool
    if pool is None:
        raise RuntimeError("the auto-sized Chunk Cache pool is read before the engine sized it")
    return pool


def recorded_pages(vllm_config) -> int | None:
    """The pool's page count recorded in this engine's config, if any (the ready response's)."""
    settings = recorded_settings(vllm_config)
    return None if settings is None or settings.pool is None else settings.pool.num_pages
