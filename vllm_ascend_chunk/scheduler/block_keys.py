"""Prefix-cache namespace of chunk-path requests (patch `vllm.v1.core.kv_cache_utils`).

Blocks of a chunk-path request hold chunk-semantics KV (no cross-chunk attention, shifted
positions), so they must never serve an ordinary request as a prefix hit. Their first block
hash gets an extra key naming the chunk structure and layout; hashes chain, so every later
block is namespaced too, while requests with the same structure still share blocks.
"""

from __future__ import annotations

from vllm_ascend_chunk.config import get_config


def block_hash_keys(request, start_token_idx: int) -> list[str]:
    info = getattr(request, "chunk_cache", None)
    if info is None or start_token_idx != 0:
        return []
    lens = ",".join(map(str, info.chunk_lens))
    return [f"chunk-cache:{get_config().layout}:{info.sys_len}:{lens}"]
