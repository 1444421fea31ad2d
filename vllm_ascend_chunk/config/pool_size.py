"""One engine's pool: its row format, computed from the engine's config, and its size.

The number of pages comes from `VLLM_CHUNK_CACHE_SIZE_GB` when it is set (`configured_pages`,
decided by `engine.configure`). Unset, the engine core sizes the pool once it knows the KV memory
(`geometry.auto_pool_bytes`, `engine.carve_out_pool`). Either way the sized pool is recorded once
in the engine's settings (`engine_settings.record_pool`), where every process reads it
(`engine_settings.pool_geometry`): the scheduler and an in-process worker share that config,
workers in other processes and the frontend are told (a worker RPC; the engine's ready response,
patches `vllm.v1.engine*`). The functions here compute and keep nothing.

Pipeline parallelism: every stage keeps a pool of the same rows (the scheduler addresses them
once for all stages) holding its own attention layers (`stage_geometry`); the engine-wide
geometry counts the layers of the widest stage, so a page's bytes bound every worker's.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from vllm_ascend_chunk.config.engine_settings import pool_geometry
from vllm_ascend_chunk.config.settings import ChunkCacheConfig
from vllm_ascend_chunk.core.geometry import PoolGeometry


def kv_dtype(vllm_config) -> torch.dtype:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise ValueError(
            f"Chunk Cache supports only the model dtype for the KV cache "
            f"(kv_cache_dtype=auto), got {cache_dtype!r}. Set "
            "VLLM_ENABLE_CHUNK_CACHE=false to use a quantized KV cache."
        )
    return vllm_config.model_config.dtype


def pool_shape(vllm_config) -> PoolGeometry:
    """The pool's row format for this engine, without its size (validates the KV dtype)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    layers = max(stage_layers(vllm_config, pp) for pp in range(parallel.pipeline_parallel_size))
    if layers == 0:  # `config.engine` turns the chunk cache off for such models first
        raise ValueError("Chunk Cache needs attention layers; this model has none.")
    return PoolGeometry(
        num_layers=layers,
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        dtype=kv_dtype(vllm_config),
        num_pages=0,
    )


def stage_layers(vllm_config, pp_rank: int) -> int:
    """Attention layers of pipeline stage `pp_rank` (all of them without pipeline parallelism)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    stage = copy.copy(parallel)  # vLLM finds the stage of `rank`: the first worker of `pp_rank`
    stage.rank = pp_rank * parallel.tensor_parallel_size
    return model.get_num_layers_by_block_type(stage, "attention")


def stage_geometry(vllm_config, pp_rank: int) -> PoolGeometry:
    """The pool of a worker of pipeline stage `pp_rank`: the engine's rows, the stage's layers."""
    return replace(pool_geometry(vllm_config), num_layers=stage_layers(vllm_config, pp_rank))


def configured_pages(shape: PoolGeometry, settings: ChunkCacheConfig) -> int | None:
    """Pages of a pool of `VLLM_CHUNK_CACHE_SIZE_GB`; None when it is unset (auto)."""
    return None if settings.size_gb is None else int(settings.size_gb * 2**30) // shape.page_bytes


def sized(shape: PoolGeometry, pages: int, settings: ChunkCacheConfig) -> PoolGeometry:
    """The pool of `pages` pages of `shape`, with the host tier `settings` give it."""
    return replace(shape, num_pages=pages, num_host_pages=int(settings.host_gb * 2**30) // shape.page_bytes)
