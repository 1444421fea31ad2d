"""Reading K/V back out of paged caches (how chunk prefills fill the pool), without an engine.

Every reader must return exactly what the platform's own cache-write op wrote: the CPU_ATTN op
itself (its ISA packing learned by `probe_layout`), the flash layout CUDA backends share, and
vllm-ascend's ND pair through the reference of its write op.
"""

from __future__ import annotations

import pytest
import torch

from vllm_ascend_chunk.ops.base import plain_reader
from vllm_ascend_chunk.ops.cpu import cpu_reader, cpu_writer, index_reader, probe_layout
from vllm_ascend_chunk.ops.npu import reshape_and_cache_reference


def _random_kv(
    tokens: int, heads: int, head_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(tokens, heads, head_size).to(dtype) for _ in range(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("block_size", "heads", "head_size"), [(16, 2, 64), (32, 3, 32), (128, 1, 128), (16, 4, 80)]
)
def test_cpu_reader_returns_what_the_cpu_attn_op_wrote(dtype, block_size, heads, head_size):
    kv_cache = torch.zeros(6, heads, block_size, 2 * head_size, dtype=dtype)
    key, value = _random_kv(40, heads, head_size, dtype)
    slots = torch.randperm(6 * block_size)[:40]
    cpu_writer(kv_cache, "auto")(key, value, slots)
    got_key, got_value = cpu_reader(kv_cache, "auto")(slots)
    assert torch.equal(got_key, key) and torch.equal(got_value, value)


def test_probe_learns_a_packed_layout():
    """A made-up packing: keys transposed to [head, dim, token] with tokens reversed."""
    heads, block_size, head_size = 2, 8, 4
    key_cache = torch.zeros(3, heads, head_size, block_size)
    value_cache = torch.zeros(3, block_size, heads, head_size)

    def write(key, value, slots):
        blocks, offsets = slots // block_size, block_size - 1 - slots % block_size
        key_cache[blocks, :, :, offsets] = key
        value_cache[slots // block_size, slots % block_size] = value

    shape = (block_size, heads, head_size)
    key_index, value_index = probe_layout(write, key_cache[:2], value_cache[:2], shape)
    key, value = _random_kv(5, heads, head_size, torch.float32)
    slots = torch.tensor([0, 9, 17, 23, 4])
    write(key, value, slots)
    got = index_reader(key_cache, value_cache, key_index, value_index)(slots)
    assert torch.equal(got[0], key) and torch.equal(got[1], value)


def test_probe_refuses_a_layout_that_is_not_a_permutation():
    """A write op that drops half of each key (e.g. a quantizing or padded layout) is refused."""
    heads, block_size, head_size = 1, 4, 4
    cache = torch.zeros(2, block_size, heads, 2 * head_size)
    key_view, value_view = cache[..., :head_size], cache[..., head_size:]

    def write(key, value, slots):
        key_view[slots // block_size, slots % block_size, :, :2] = key[..., :2]
        value_view[slots // block_size, slots % block_size] = value

    with pytest.raises(NotImplementedError, match="permutation"):
        probe_layout(write, key_view, value_view, (block_size, heads, head_size))


@pytest.mark.parametrize("hnd", [False, True])
def test_plain_reader_on_the_flash_layout(hnd):
    """CUDA backends' [blocks, 2, block, heads, head] cache, NHD or HND strides."""
    blocks, block_size, heads, head_size = 5, 16, 2, 8
    if hnd:
        kv_cache = torch.zeros(blocks, 2, heads, block_size, head_size).transpose(2, 3)
    else:
        kv_cache = torch.zeros(blocks, 2, block_size, heads, head_size)
    key_cache, value_cache = kv_cache.unbind(1)
    key, value = _random_kv(7, heads, head_size, torch.float32)
    slots = torch.tensor([3, 17, 18, 40, 79, 0, 64])
    key_cache[slots // block_size, slots % block_size] = key  # as reshape_and_cache_flash does
    value_cache[slots // block_size, slots % block_size] = value
    got = plain_reader(key_cache, value_cache)(slots)
    assert torch.equal(got[0], key) and torch.equal(got[1], value)


def test_plain_reader_on_the_ascend_nd_pair():
    blocks, block_size, heads, head_size = 3, 128, 2, 16
    caches = tuple(torch.zeros(blocks, block_size, heads, head_size, dtype=torch.bfloat16) for _ in range(2))
    key, value = _random_kv(9, heads, head_size, torch.bfloat16)
    slots = torch.tensor([0, 127, 128, 300, 5, 6, 7, 200, 383], dtype=torch.int32)
    reshape_and_cache_reference(key, value, *caches, slots)
    got = plain_reader(*caches)(slots.to(torch.int64))
    assert torch.equal(got[0], key) and torch.equal(got[1], value)
