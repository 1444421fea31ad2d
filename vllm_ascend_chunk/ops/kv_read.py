"""Reading K/V rows back out of a layer's paged KV cache: how chunk prefills fill the pool.

A chunk prefill's tokens are copied from the slots its forward wrote into the pool after the
forward (the connector's `wait_for_save`), never inside the attention op: a step replayed from
a CUDA or ACL graph runs no Python code in the op, but its cache writes happen all the same, so
what the pool gets does not depend on how the step was executed.

Plain layouts (CUDA's flash layout, vllm-ascend's ND pair) are indexed by block and offset. The
CPU backend packs keys per ISA; its layout is learned once from the backend's own cache-write
op: a probe writes each element's index (in base-256 digits, exact in every float dtype) into a
scratch cache and reads where it landed, then a round trip checks the result.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from vllm_ascend_chunk.ops.kv_write import KVWriter, cpu_cache_views, cpu_writer

KVReader = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""`read(slots [T] int64) -> (key [T, H, D], value [T, H, D])`."""

BlockIndex = tuple[torch.Tensor, ...]
"""Per dimension of a cache view's block (`view[b]`), the index of each [token, head, dim]."""

_DIGIT = 256
"""Every float dtype a KV cache has (fp32, fp16, bf16) holds the integers 0..256 exactly."""


def make_kv_reader(kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], vllm_config) -> KVReader:
    """The paged-cache → K/V reader for one layer on the current platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return plain_reader(*kv_cache.unbind(1))  # [blocks, 2, block, heads, head] (flash layout)
    if current_platform.device_type == "npu":  # (k_cache, v_cache), checked by `npu_kv_writer`
        return plain_reader(*kv_cache)
    if current_platform.is_cpu():
        return cpu_reader(kv_cache, vllm_config.cache_config.cache_dtype)
    raise NotImplementedError(
        f"Chunk Cache has no KV reader for platform {current_platform.device_name!r}; "
        "set VLLM_ENABLE_CHUNK_CACHE=false"
    )


def plain_reader(key_cache: torch.Tensor, value_cache: torch.Tensor) -> KVReader:
    """Reader of `[blocks, block_size, heads, head_size]` K and V caches (any strides)."""
    block_size = key_cache.shape[1]

    def read(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = slots // block_size, slots % block_size
        return key_cache[blocks, offsets], value_cache[blocks, offsets]

    return read


def cpu_reader(kv_cache: torch.Tensor, cache_dtype: str) -> KVReader:
    """Reader of a CPU_ATTN cache `[blocks, heads, block_size, 2 * head_size]` (ISA-packed)."""
    _, heads, block_size, double_head = kv_cache.shape
    key_index, value_index = _cpu_layout(heads, block_size, double_head, kv_cache.dtype, cache_dtype)
    return index_reader(*cpu_cache_views(kv_cache), key_index, value_index)


@functools.cache
def _cpu_layout(
    heads: int, block_size: int, double_head: int, dtype: torch.dtype, cache_dtype: str
) -> tuple[BlockIndex, BlockIndex]:
    """One probe per cache geometry (every layer of a model shares it)."""
    scratch = torch.zeros((2, heads, block_size, double_head), dtype=dtype)
    return probe_layout(
        cpu_writer(scratch, cache_dtype), *cpu_cache_views(scratch), (block_size, heads, double_head // 2)
    )


def probe_layout(
    write: KVWriter, key_view: torch.Tensor, value_view: torch.Tensor, shape: tuple[int, int, int]
) -> tuple[BlockIndex, BlockIndex]:
    """Learn where `write` puts each token, head and dim of a block of `shape`
    `(block_size, heads, head_size)`.

    `key_view`/`value_view` are the `[blocks, ...]` K and V views, two blocks or more, of the
    scratch cache `write` writes into; `write` must place a block's elements by a fixed
    permutation within the block (any packing does). Raises NotImplementedError otherwise.
    """
    count = math.prod(shape)
    elements = torch.arange(count).view(shape)
    found_k, found_v = torch.zeros(count, dtype=torch.int64), torch.zeros(count, dtype=torch.int64)
    for place in (_DIGIT**i for i in range(max(1, math.ceil(math.log(count, _DIGIT))))):
        digit = (elements // place % _DIGIT).to(key_view.dtype)
        write(digit, digit, torch.arange(shape[0]))
        found_k += key_view[0].reshape(-1).to(torch.int64) * place
        found_v += value_view[0].reshape(-1).to(torch.int64) * place
    indexes = _inverse(found_k, key_view, shape), _inverse(found_v, value_view, shape)
    _check_round_trip(write, key_view, value_view, indexes, shape)
    return indexes


def index_reader(
    key_cache: torch.Tensor, value_cache: torch.Tensor, key_index: BlockIndex, value_index: BlockIndex
) -> KVReader:
    """Reader of K and V cache views whose block layouts are given by `probe_layout`."""
    block_size = key_index[0].shape[0]

    def read(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = (slots // block_size).view(-1, 1, 1), slots % block_size
        return (
            key_cache[(blocks, *(i[offsets] for i in key_index))],
            value_cache[(blocks, *(i[offsets] for i in value_index))],
        )

    return read


def _inverse(found: torch.Tensor, view: torch.Tensor, shape: tuple[int, int, int]) -> BlockIndex:
    """`found[p]`: the element at flat position p of a block; → where each element is."""
    count = found.numel()
    if view[0].numel() != count or not torch.equal(found.sort().values, torch.arange(count)):
        raise NotImplementedError(
            f"Chunk Cache cannot read this KV cache layout (a block of {tuple(view.shape[1:])} is not "
            "a permutation of its tokens' K/V); set VLLM_ENABLE_CHUNK_CACHE=false"
        )
    where = torch.empty_like(found)
    where[found] = torch.arange(count)
    return tuple(i.view(shape) for i in torch.unravel_index(where, view.shape[1:]))


def _check_round_trip(
    write: KVWriter,
    key_view: torch.Tensor,
    value_view: torch.Tensor,
    indexes: tuple[BlockIndex, BlockIndex],
    shape: tuple[int, int, int],
) -> None:
    key, value = (torch.randn(shape).to(key_view.dtype) for _ in range(2))
    slots = torch.arange(shape[0], 2 * shape[0])
    write(key, value, slots)
    got = index_reader(key_view, value_view, *indexes)(slots)
    if not (torch.equal(got[0], key) and torch.equal(got[1], value)):
        raise NotImplementedError(
            "Chunk Cache: the KV cache layout learned from the backend's write op "
            "does not read back what it wrote; set VLLM_ENABLE_CHUNK_CACHE=false"
        )
