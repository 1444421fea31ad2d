"""Pool geometry, computed identically in every process from the engine config.

The pool holds post-RoPE K and V of every attention layer for a number of tokens, in pages of
`PAGE_SIZE` tokens so that entries of any length never fragment it. The frontend uses the
geometry to refuse chunk sets that can never fit, the scheduler to allocate pages, the worker to
size the tensors, and the engine core to carve the pool out of the paged-KV budget. The host
tier has the same row format, in `num_host_pages` pages of host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vllm_ascend_chunk.config import get_config
from vllm_ascend_chunk.paging import pages_for

PAGE_SIZE = 16
"""Tokens per pool page."""


@dataclass(frozen=True)
class PoolGeometry:
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    num_pages: int
    page_size: int = PAGE_SIZE
    num_host_pages: int = 0
    """Pages of the host-memory tier (`VLLM_CHUNK_CACHE_HOST_GB`; 0: none)."""

    @property
    def num_rows(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def num_bytes(self) -> int:
        return self.num_rows * self.bytes_per_token

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)


def kv_dtype(vllm_config) -> torch.dtype:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise ValueError(
            f"Chunk Cache supports only the model dtype for the KV cache "
            f"(kv_cache_dtype=auto), got {cache_dtype!r}. Set "
            "VLLM_ENABLE_CHUNK_CACHE=false to use a quantized KV cache."
        )
    return vllm_config.model_config.dtype


def pool_geometry(vllm_config) -> PoolGeometry:
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    layers = model.get_num_layers_by_block_type(parallel, "attention")
    heads = model.get_num_kv_heads(parallel)
    head_size = model.get_head_size()
    dtype = kv_dtype(vllm_config)
    if layers == 0:  # `engine_config` turns the chunk cache off for such models first
        raise ValueError("Chunk Cache needs attention layers; this model has none.")
    shape = PoolGeometry(num_layers=layers, num_kv_heads=heads, head_size=head_size, dtype=dtype, num_pages=0)
    page_bytes = shape.bytes_per_token * shape.page_size
    config = get_config()
    return replace(
        shape,
        num_pages=int(config.size_gb * 2**30) // page_bytes,
        num_host_pages=int(config.host_gb * 2**30) // page_bytes,
    )
