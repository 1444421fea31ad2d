"""Writing K/V rows into a layer's paged KV cache through the backend's own cache-write op.

Every backend owns its layout (the CPU one is ISA-packed), so the pool never decodes it: rows
are written with the op the attention backend itself uses. One writer per layer. A loader moves
pool rows into slots, re-rotating keys on the way (sequential layout): gather, rotate, write, or
one fused Triton kernel on CUDA, whose flash layout is plain.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_ascend_chunk.ops.rotary import Rotation

KVWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""`write(key [T, H, D], value [T, H, D], slots [T] int64)`."""
KVLoader = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Rotation | None], None]
"""`load(pool_key [R, H, D], pool_value [R, H, D], rows [T], slots [T], rotation)`."""

STAGING_ROWS = 8192
"""Rows a gathering loader moves at a time: its staging memory is two pieces, not the whole load."""


class Staging:
    """Reusable K and V gather buffers of `STAGING_ROWS` rows, shared by every layer's loader.

    On the CPU a fresh multi-MB tensor per layer and step costs more in page faults than the
    gather itself (36 MB: 17 ms into a new tensor, 3 ms into a warm one), and a warm 32 x 1K
    request gathers 0.4 GB. Layers load one after another, so one pair serves them all.
    """

    def __init__(self) -> None:
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def take(self, like: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `rows` rows (at most `STAGING_ROWS`) of K and V buffers shaped like `like`'s rows."""
        shape = (STAGING_ROWS, *like.shape[1:])
        buffers = self._buffers
        if buffers is None or buffers[0].shape != shape or buffers[0].dtype != like.dtype:
            buffers = self._buffers = tuple(
                torch.empty(shape, dtype=like.dtype, device=like.device) for _ in "kv"
            )
        return buffers[0][:rows], buffers[1][:rows]


def make_kv_loader(
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], layer, vllm_config, staging: Staging
) -> KVLoader:
    """The pool → paged-cache loader for one layer on the current platform (`staging`: the
    buffers the gathering loaders of every layer share)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        from vllm_ascend_chunk.ops.triton_kv_load import load_into_paged

        key_cache, value_cache = kv_cache.unbind(1)  # [blocks, 2, block, heads, head] (flash layout)
        return lambda pool_k, pool_v, rows, slots, rotation: load_into_paged(
            pool_k, pool_v, rows, slots, key_cache, value_cache, rotation
        )
    rotate = Rotation.apply_
    if current_platform.device_type == "npu":
        from vllm_ascend_chunk.ops.npu import npu_apply_rotation_

        rotate = lambda rotation, keys: npu_apply_rotation_(  # noqa: E731
            keys, rotation.cos, rotation.sin, rotation.spec
        )
    write = make_kv_writer(kv_cache, layer, vllm_config)

    def load(
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        rotation: Rotation | None,
    ) -> None:
        for start in range(0, len(rows), STAGING_ROWS):
            piece = slice(start, start + STAGING_ROWS)
            key, value = staging.take(pool_k, len(rows[piece]))
            torch.index_select(pool_k, 0, rows[piece], out=key)
            if rotation is not None:
                rotate(rotation.piece(piece), key)
            torch.index_select(pool_v, 0, rows[piece], out=value)
            write(key, value, slots[piece])

    return load


def make_kv_writer(
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], layer, vllm_config
) -> KVWriter:
    """The writer for one layer's paged cache on the current platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return cpu_writer(kv_cache, vllm_config.cache_config.cache_dtype)
    if current_platform.device_type == "npu":  # vllm-ascend: a (k_cache, v_cache) pair per layer
        from vllm_ascend_chunk.ops.npu import npu_kv_writer

        return npu_kv_writer(kv_cache, layer)
    raise NotImplementedError(
        f"Chunk Cache has no KV writer for platform {current_platform.device_name!r}; "
        "set VLLM_ENABLE_CHUNK_CACHE=false"
    )


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
