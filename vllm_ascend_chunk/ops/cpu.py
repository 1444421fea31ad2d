"""The CPU backend: vLLM's CPU_ATTN paged cache, written with its own op and read back.

CPU_ATTN keeps each layer's cache as `[blocks, heads, block_size, 2 * head_size]`, K and V
packed per ISA. Rows are written with the backend's own cache-write op; its layout is learned
once from that op to read slots back: a probe writes each element's index (in base-256 digits,
exact in every float dtype) into a scratch cache and reads where it landed, then a round trip
checks the result.
"""

from __future__ import annotations

import functools
import math

import torch

from vllm_ascend_chunk.ops.base import KVReader, KVWriter

BlockIndex = tuple[torch.Tensor, ...]
"""Per dimension of a cache view's block (`view[b]`), the index of each [token, head, dim]."""

_DIGIT = 256
"""Every float dtype a KV cache has (fp32, fp16, bf16) holds the integers 0..256 exactly."""


def cpu_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V views CPU_ATTN's forward uses: [blocks, heads, 2 * block, head] split in K | V."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)


def cpu_writer(kv_cache: torch.Tensor, cache_dtype: str) -> KVWriter:
    """The writer of a CPU_ATTN cache `[blocks, heads, block_size, 2 * head_size]`."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    key_cache, value_cache = cpu_cache_views(kv_cache)
    isa = _get_attn_isa(kv_cache.dtype, kv_cache.shape[2], key_cache.shape[-1], cache_dtype)

    def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, isa, kv_cache_dtype=cache_dtype
        )

    return write


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
