"""Prefix-cache namespace of chunk-path requests (patch `vllm.v1.core.kv_cache_utils`).

Blocks of a chunk-path request hold chunk-semantics KV (no cross-chunk attention, shifted
positions), so they must never serve an ordinary request as a prefix hit. Their first block
hash gets an extra key naming the chunk structure and layout; hashes chain, so every later
block is namespaced too, while requests with the same structure still share blocks.

The key shares vLLM's extra-keys list with the request's `cache_salt` and LoRA name (strings),
prompt-embeds hashes (bytes) and multi-modal keys (`(identifier, offset)` pairs), so it is a
4-tuple: no value a client controls can equal it, and vLLM's block hashers (pickle- and
CBOR-based) encode a tuple differently from a string.
"""

from __future__ import annotations

from vllm_ascend_chunk.config import get_config

NAMESPACE = "vllm-ascend-chunk"

ChunkBlockKey = tuple[str, str, int, tuple[int, ...]]


def block_hash_keys(request, start_token_idx: int) -> list[ChunkBlockKey]:
    info = getattr(request, "chunk_cache", None)
    if info is None or start_token_idx != 0:
        return []
    return [(NAMESPACE, get_config().layout, info.sys_len, tuple(info.chunk_lens))]
