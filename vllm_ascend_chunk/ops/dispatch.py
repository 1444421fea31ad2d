"""The KV ops of the current platform: one layer's writer, loader and reader, from its backend.

CPU: CPU_ATTN's own cache-write op, the layout learned from it to read back (`cpu`). CUDA: one
fused Triton kernel loads (`triton_kv_load`); the flash layout is plain to read. Ascend:
vllm-ascend's cache-write op and the fused rotary op (`npu`); its ND pair is plain to read.

A chunk prefill's tokens are copied from the slots its forward wrote into the pool after the
forward (the connector's `wait_for_save`), never inside the attention op: a step replayed from
a CUDA or ACL graph runs no Python code in the op, but its cache writes happen all the same, so
what the pool gets does not depend on how the step was executed.
"""

from __future__ import annotations

import torch

from vllm_ascend_chunk.ops.base import KVLoader, KVReader, KVWriter, Staging, gathering_loader, plain_reader
from vllm_ascend_chunk.ops.cpu import cpu_reader, cpu_writer
from vllm_ascend_chunk.ops.rotary import Rotation


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
    return gathering_loader(make_kv_writer(kv_cache, layer, vllm_config), rotate, staging)


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
