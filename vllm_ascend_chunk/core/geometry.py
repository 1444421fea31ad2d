"""Pool geometry, the same in every process of an engine.

The pool holds post-RoPE K and V of every attention layer for a number of tokens, in pages of
`PAGE_SIZE` tokens so that entries of any length never fragment it. The frontend uses the
geometry to refuse chunk sets that can never fit, the scheduler to allocate pages, the worker to
size the tensors, and the engine core to carve the pool out of the paged-KV budget. The host
tier has the same row format, in `num_host_pages` pages of host memory. One engine's geometry,
read from its config, is `config.pool_size`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ascend_chunk.core.paging import pages_for

PAGE_SIZE = 16
"""Tokens per pool page."""
AUTO_FRACTION = 0.25
"""Share of the engine's KV memory that an auto-sized pool takes..."""
AUTO_FLOOR = 256 * 2**20
AUTO_CEILING = 8 * 2**30
"""...at least `AUTO_FLOOR` and at most `AUTO_CEILING` bytes, and never more than half of it."""


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

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)


def auto_pool_bytes(kv_bytes: int) -> int:
    """The pool of an engine with `kv_bytes` of KV memory and no `VLLM_CHUNK_CACHE_SIZE_GB`."""
    return min(max(int(AUTO_FRACTION * kv_bytes), AUTO_FLOOR), AUTO_CEILING, kv_bytes // 2)
