"""Fused pool → paged-cache load for CUDA: gather pool rows, re-rotate keys, write slots.

The flash layout (`[blocks, block_size, kv_heads, head_size]` K and V views, NHD or HND strides)
is plain, so one Triton program per token (and group of heads) reads a pool row, applies the rotary
correction of `rotary.apply_rotation_` (float32 math, one rounding) to the key and writes key and
value into the token's slot. Slots < 0 are skipped, as `reshape_and_cache_flash` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ascend_chunk.ops.rotary import Rotation


@triton.jit
def _load_kernel(
    pool_k,
    pool_v,
    rows,
    slots,
    cos,
    sin,
    key_cache,
    value_cache,
    pool_row_stride,
    pool_head_stride,
    block_stride,
    token_stride,
    head_stride,
    table_stride,
    block_size,
    num_heads,
    HEAD_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    NEOX: tl.constexpr,
    ROTATE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        row = tl.load(rows + t).to(tl.int64)
        head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
        mask = (head < num_heads) & (d < HEAD_SIZE)
        src = row * pool_row_stride + head * pool_head_stride
        dst = (slot // block_size) * block_stride + (slot % block_size) * token_stride + head * head_stride
        value = tl.load(pool_v + src + d, mask=mask)
        tl.store(value_cache + dst + d, value.to(value_cache.dtype.element_ty), mask=mask)
        key = tl.load(pool_k + src + d, mask=mask)
        if ROTATE:
            half: tl.constexpr = ROTARY_DIM // 2
            rotated = mask & (d < ROTARY_DIM)
            if NEOX:  # pairs (i, i + half)
                first = d < half
                pair = tl.where(first, d, d - half)
                partner = tl.where(first, d + half, d - half)
            else:  # GPT-J: pairs (2i, 2i + 1)
                first = d % 2 == 0
                pair = d // 2
                partner = tl.where(first, d + 1, d - 1)
            c = tl.load(cos + t * table_stride + pair, mask=d < ROTARY_DIM, other=1.0)
            s = tl.load(sin + t * table_stride + pair, mask=d < ROTARY_DIM, other=0.0)
            other = tl.load(pool_k + src + partner, mask=rotated, other=0.0).to(tl.float32)
            own = key.to(tl.float32)
            moved = tl.where(first, own * c - other * s, own * c + other * s)
            key = tl.where(rotated, moved, own)
        tl.store(key_cache + dst + d, key.to(key_cache.dtype.element_ty), mask=mask)


def load_into_paged(
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rotation: Rotation | None,
) -> None:
    """Write pool rows [R, H, D] ``rows`` [T] into ``slots`` [T] of the paged K/V caches
    [blocks, block_size, H, D], keys moved by ``rotation`` (None: a plain copy)."""
    num_tokens = rows.shape[0]
    num_heads, head_size = pool_k.shape[1:]
    if slots.shape != rows.shape or key_cache.shape[2:] != (num_heads, head_size):
        raise ValueError(
            f"rows {tuple(rows.shape)} / slots {tuple(slots.shape)} / cache "
            f"{tuple(key_cache.shape)} do not match pool rows of {num_heads}x{head_size}"
        )
    if key_cache.stride() != value_cache.stride() or pool_k.stride() != pool_v.stride():
        raise ValueError("K and V must share strides (pool and cache)")
    if pool_k.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("head_size must be the innermost, contiguous dimension")
    if num_tokens == 0:
        return
    if rotation is not None:
        cos, sin, spec = rotation.cos.contiguous(), rotation.sin.contiguous(), rotation.spec
        if cos.shape != (num_tokens, spec.rotary_dim // 2) or spec.head_size != head_size:
            raise ValueError(
                f"rotation tables {tuple(cos.shape)} do not match {num_tokens} rows of head_size {head_size}"
            )
        rotary_dim, neox, table_stride = spec.rotary_dim, spec.is_neox_style, cos.stride(0)
    else:
        cos = sin = pool_k  # never read
        rotary_dim, neox, table_stride = head_size, True, 0
    block_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // triton.next_power_of_2(head_size)))
    _load_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        pool_k,
        pool_v,
        rows,
        slots,
        cos,
        sin,
        key_cache,
        value_cache,
        pool_k.stride(0),
        pool_k.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        table_stride,
        key_cache.shape[1],
        num_heads,
        HEAD_SIZE=head_size,
        ROTARY_DIM=rotary_dim,
        NEOX=neox,
        ROTATE=rotation is not None,
        BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(head_size),
    )
