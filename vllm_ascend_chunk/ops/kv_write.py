"""Writing K/V rows into a layer's paged KV cache through the backend's own cache-write op.

Every backend owns its layout (the CPU one is ISA-packed), so the pool never decodes it: rows
are written with the op the attention backend itself uses. One writer per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KVWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""`write(key [T, H, D], value [T, H, D], slots [T] int64)`."""


def make_kv_writer(kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], layer,
                   vllm_config) -> KVWriter:
    """The writer for one layer's paged cache on the current platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return _cpu_writer(kv_cache, vllm_config)
    if current_platform.is_cuda_alike():
        return _flash_writer(kv_cache, layer)
    if current_platform.device_type == "npu":  # vllm-ascend: a (k_cache, v_cache) pair per layer
        from vllm_ascend_chunk.ops.npu import npu_kv_writer

        return npu_kv_writer(kv_cache, layer)
    raise NotImplementedError(
        f"Chunk Cache has no KV writer for platform {current_platform.device_name!r}; "
        "set VLLM_ENABLE_CHUNK_CACHE=false")


def _cpu_writer(kv_cache: torch.Tensor, vllm_config) -> KVWriter:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    # The same views CPU_ATTN's forward uses: [blocks, heads, 2 * block, head] split in K | V.
    key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
    cache_dtype = vllm_config.cache_config.cache_dtype
    isa = _get_attn_isa(kv_cache.dtype, block_size, key_cache.shape[-1], cache_dtype)

    def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                       kv_cache_dtype=cache_dtype)

    return write


def _flash_writer(kv_cache: torch.Tensor, layer) -> KVWriter:
    from vllm import _custom_ops as ops

    key_cache, value_cache = kv_cache.unbind(1)  # [blocks, 2, block, heads, head] (FA/FlashInfer/Triton)

    def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto",
                                    layer._k_scale, layer._v_scale)

    return write
