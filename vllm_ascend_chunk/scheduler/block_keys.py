"""Prefix-cache namespace of chunk-path requests (patch `vllm.v1.core.kv_cache_utils`).

Blocks of a chunk-path request hold chunk-semantics KV (no cross-chunk attention, shifted
positions), so they must never serve an ordinary request as a prefix hit. Their first block
hash gets an extra key naming the chunk structure and the engine (the SYSTEM prompt's content
key, which covers the engine's identity: model, layout, ...; `frontend.keys.engine_identity`);
hashes chain, so every later
block is namespaced too, while requests with the same structure still share blocks.

A `qattn` request rewrites the K/V of its blocks while it runs, and what it leaves there depends
on its question: its key names the request itself, so that no other request ever shares its
blocks (and the request reads no prefix cache: `coordinator.on_new_request`).

The key shares vLLM's extra-keys list with the request's `cache_salt` and LoRA name (strings),
prompt-embeds hashes (bytes) and multi-modal keys (`(identifier, offset)` pairs), so it is a
4-tuple: no value a client controls can equal it, and vLLM's block hashers (pickle- and
CBOR-based) encode a tuple differently from a string.
"""

from __future__ import annotations

NAMESPACE = "vllm-ascend-chunk"

ChunkBlockKey = tuple[str, str, int, tuple[int, ...]]


def block_hash_keys(request, start_token_idx: int) -> list[ChunkBlockKey]:
    info = getattr(request, "chunk_cache", None)
    if info is None or start_token_idx != 0:
        return []
    engine = getattr(info, "sys_hash", b"").hex()  # the engine's identity, its layout included
    if getattr(info, "fraction", 0):
        engine = f"{engine}/qattn:{request.request_id}"
    return [(NAMESPACE, engine, info.sys_len, tuple(info.chunk_lens))]
