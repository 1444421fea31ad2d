"""Ascend NPU ops: the KV writer for vllm-ascend's paged cache and the fused rotary correction.

vllm-ascend keeps each attention layer's cache as a ``(k_cache, v_cache)`` pair, each
``[num_blocks, block_size, num_kv_heads, head_size]`` in ND format (block size 128 by default),
addressed by int32 slots: ``slot = block * block_size + offset``. Rows are written with the
backend's own cache-write op, ``vllm_ascend.device.device_op.DeviceOperator.reshape_and_cache``
(``torch_npu._npu_reshape_and_cache`` on Atlas A2/A3, ``torch_npu.npu_scatter_pa_kv_cache`` on
A5). Every device op here has a pure-torch reference with the same contract; the tests run the
references and all the code around the device calls on CPU, and `tools/deploy/npu_selfcheck.py`
compares the device ops with the references on hardware. torch_npu and vllm_ascend are imported
only when a device op is first needed, so this module imports anywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_ascend_chunk.ops.base import KVWriter
from vllm_ascend_chunk.ops.rotary import RotarySpec

ReshapeAndCache = Callable[..., None]
"""`op(key=, value=, key_cache=, value_cache=, slot_mapping=)`: token i's K/V into slot i (int32)."""

RotaryMul = Callable[..., torch.Tensor]
"""`op(x, r1, r2, rotary_mode="half" | "interleave") -> r1 * x + r2 * rotate(x)` (a new tensor)."""


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Pure-torch `DeviceOperator.reshape_and_cache`: write ``key``/``value`` [T, H, D] into slots."""
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    if slots.numel() and not 0 <= int(slots.min()) <= int(slots.max()) < key_cache.shape[0] * block_size:
        raise IndexError(f"slots must lie in [0, {key_cache.shape[0] * block_size})")
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def device_reshape_and_cache() -> ReshapeAndCache:
    """vllm-ascend's cache-write op for the NPU in use (imports torch_npu)."""
    from vllm_ascend.device.device_op import DeviceOperator

    return DeviceOperator.reshape_and_cache


def npu_kv_writer(
    kv_cache: tuple[torch.Tensor, torch.Tensor], layer=None, write_op: ReshapeAndCache | None = None
) -> KVWriter:
    """The `KVWriter` of one layer's ``(k_cache, v_cache)`` pair (``write_op``: the device op)."""
    if not (
        isinstance(kv_cache, (tuple, list))
        and len(kv_cache) == 2
        and all(isinstance(c, torch.Tensor) and c.dim() == 4 for c in kv_cache)
        and kv_cache[0].shape == kv_cache[1].shape
    ):
        shapes = (
            [tuple(c.shape) for c in kv_cache]
            if isinstance(kv_cache, (tuple, list))
            else tuple(kv_cache.shape)
        )
        raise NotImplementedError(
            "Chunk Cache supports vllm-ascend's ND paged KV cache: a (k_cache, v_cache) pair of "
            f"[num_blocks, block_size, num_kv_heads, head_size] tensors; got {shapes} (Atlas 300I "
            "and MLA caches are not supported). Set VLLM_ENABLE_CHUNK_CACHE=false."
        )
    key_cache, value_cache = kv_cache
    if layer is not None and tuple(key_cache.shape[2:]) != (layer.num_kv_heads, layer.head_size):
        raise NotImplementedError(
            f"KV cache of {layer.layer_name} is {tuple(key_cache.shape)}, not [blocks, block_size, "
            f"{layer.num_kv_heads}, {layer.head_size}]: an unsupported NPU layout. "
            "Set VLLM_ENABLE_CHUNK_CACHE=false."
        )
    op = write_op or device_reshape_and_cache()

    def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        op(
            key=key,
            value=value,
            key_cache=key_cache,
            value_cache=value_cache,
            slot_mapping=slots.to(torch.int32),
        )

    return write


def rotary_mul_reference(
    x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
) -> torch.Tensor:
    """Pure-torch ``torch_npu.npu_rotary_mul`` as documented: ``r1 * x + r2 * rotate(x)``.

    ``rotate`` maps the pairs (x1, x2) to (-x2, x1): the halves of the last dim ("half") or its
    even/odd elements ("interleave").
    """
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        raise ValueError(f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    return r1 * x + r2 * rotated


def device_rotary_mul() -> RotaryMul:
    """``torch_npu.npu_rotary_mul``."""
    import torch_npu

    return torch_npu.npu_rotary_mul


def npu_apply_rotation_(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    spec: RotarySpec,
    rotary_mul: RotaryMul | None = None,
) -> torch.Tensor:
    """`rotary.apply_rotation_` on one fused op (``rotary_mul``: ``torch_npu.npu_rotary_mul``).

    Same contract: ``keys`` [T, H, head_size] rotated in place by ``cos``/``sin``
    [T, rotary_dim // 2]; math in float32 (float64 for float64 keys), one rounding; dims past
    ``rotary_dim`` untouched. Returns ``keys``.
    """
    half = spec.rotary_dim // 2
    if (
        keys.dim() != 3
        or keys.shape[-1] != spec.head_size
        or cos.shape != (keys.shape[0], half)
        or sin.shape != cos.shape
    ):
        raise ValueError(
            f"keys must be [T, H, {spec.head_size}] and cos/sin [T, {half}], got "
            f"{tuple(keys.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    work = torch.promote_types(keys.dtype, torch.float32)
    if spec.is_neox_style:  # pairs (i, i + half): cos/sin repeated per half
        r1, r2, mode = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1), "half"
    else:  # GPT-J pairs (2i, 2i + 1): cos/sin repeated per element
        r1, r2, mode = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1), "interleave"
    rot = keys[..., : spec.rotary_dim]
    # The layout vllm-ascend itself feeds the op: x [T, H, 1, rd], cos/sin [T, 1, 1, rd].
    out = (rotary_mul or device_rotary_mul())(
        rot.to(work).contiguous().unsqueeze(2),
        r1.to(work)[:, None, None, :],
        r2.to(work)[:, None, None, :],
        rotary_mode=mode,
    )
    rot.copy_(out.squeeze(2))
    return keys
