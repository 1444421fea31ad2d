"""One engine's pool: its row format and its size, read from the engine's config.

The number of pages comes from `VLLM_CHUNK_CACHE_SIZE_GB` when it is set. Unset, the engine core
sizes the pool once it knows the KV memory (`geometry.auto_pool_bytes`, `engine.carve_out_pool`)
and records the page count in the engine's config (`engine.record_pages`): the scheduler and an
in-process worker share that config, workers in other processes and the frontend are told
(a worker RPC; the engine's ready response, patches `vllm.v1.engine*`).

Both the row format (`pool_shape`) and the sized pool (`pool_geometry`) are computed once per
engine and kept on its config: the frontend asks for the geometry of every chunked request.

Pipeline parallelism: every stage keeps a pool of the same rows (the scheduler addresses them
once for all stages) holding its own attention layers (`stage_geometry`); the engine-wide
geometry counts the layers of the widest stage, so a page's bytes bound every worker's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

import torch

from vllm_ascend_chunk.config.settings import get_config
from vllm_ascend_chunk.core.geometry import PoolGeometry

PAGES_KEY = "chunk_cache_pool_pages"
"""Where an engine's config records the pool's page count (`kv_connector_extra_config`)."""


def kv_dtype(vllm_config) -> torch.dtype:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise ValueError(
            f"Chunk Cache supports only the model dtype for the KV cache "
            f"(kv_cache_dtype=auto), got {cache_dtype!r}. Set "
            "VLLM_ENABLE_CHUNK_CACHE=false to use a quantized KV cache."
        )
    return vllm_config.model_config.dtype


def _kept(vllm_config, name: str, compute: Callable[[object], PoolGeometry]) -> PoolGeometry:
    """`compute(vllm_config)`, once per engine: kept on its config as `name` (vLLM's copies of it,
    a MultiConnector child's or a worker process's, keep it too)."""
    if (kept := vars(vllm_config).get(name)) is None:
        kept = compute(vllm_config)
        setattr(vllm_config, name, kept)
    return kept


def pool_shape(vllm_config) -> PoolGeometry:
    """The pool's row format for this engine, without its size (validates the KV dtype)."""
    return _kept(vllm_config, "_chunk_cache_pool_shape", _shape)


def stage_layers(vllm_config, pp_rank: int) -> int:
    """Attention layers of pipeline stage `pp_rank` (all of them without pipeline parallelism)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    stage = copy.copy(parallel)  # vLLM finds the stage of `rank`: the first worker of `pp_rank`
    stage.rank = pp_rank * parallel.tensor_parallel_size
    return model.get_num_layers_by_block_type(stage, "attention")


def stage_geometry(vllm_config, pp_rank: int) -> PoolGeometry:
    """The pool of a worker of pipeline stage `pp_rank`: the engine's rows, the stage's layers."""
    return replace(pool_geometry(vllm_config), num_layers=stage_layers(vllm_config, pp_rank))


def _shape(vllm_config) -> PoolGeometry:
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


def configured_pages(shape: PoolGeometry) -> int | None:
    """Pages of a pool of `VLLM_CHUNK_CACHE_SIZE_GB`; None when it is unset (auto)."""
    size_gb = get_config().size_gb
    return None if size_gb is None else int(size_gb * 2**30) // shape.page_bytes


def recorded(vllm_config, key: str):
    """What `config.engine.record` put in this engine's config under `key`, if anything."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    return None if kv is None else (kv.kv_connector_extra_config or {}).get(key)


def recorded_pages(vllm_config) -> int | None:
    """The pool size recorded in this engine's config (`config.engine.record_pages`), if any."""
    return recorded(vllm_config, PAGES_KEY)


def pool_geometry(vllm_config) -> PoolGeometry:
    """The pool of this engine: its size set by `VLLM_CHUNK_CACHE_SIZE_GB`, or recorded (auto)."""
    return _kept(vllm_config, "_chunk_cache_pool_geometry", _sized)


def _sized(vllm_config) -> PoolGeometry:
    shape = pool_shape(vllm_config)
    pages = configured_pages(shape)
    if pages is None:
        pages = recorded_pages(vllm_config)
        if pages is None:
            raise RuntimeError("the auto-sized Chunk Cache pool is read before the engine sized it")
    return replace(
        shape, num_pages=pages, num_host_pages=int(get_config().host_gb * 2**30) // shape.page_bytes
    )
