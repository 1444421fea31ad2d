"""The prefix-cache namespace of chunk-path blocks on vLLM's real block hashing (no engine)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from vllm_ascend_chunk.core.request_info import ChunkSpans

BLOCK_SIZE = 16
INFO = ChunkSpans(sys_len=5, chunk_lens=[20, 9], question_len=6)
TOKENS = list(range(100, 100 + INFO.num_tokens))
# What `block_keys` returned before it became a tuple: any client could send it as a salt.
OLD_MARKER = "chunk-cache:overlap:5:20,9"


def hasher(hash_name: str) -> Callable[..., list[bytes]]:
    """Block hashes of a request built with `kwargs`, as vLLM's prefix cache computes them."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(hash_name)
    init_none_hash(hash_fn)  # random per call without PYTHONHASHSEED: once per comparison

    def block_hashes(request_id: str = "r", **kwargs) -> list[bytes]:
        request = Request(
            request_id,
            TOKENS,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, hash_fn),
            **kwargs,
        )
        assert len(request.block_hashes) == len(TOKENS) // BLOCK_SIZE
        return request.block_hashes

    return block_hashes


@pytest.mark.parametrize("hash_name", ["sha256_cbor", "xxhash_cbor", "sha256"])
def test_no_cache_salt_enters_the_chunk_namespace(hash_name: str):
    block_hashes = hasher(hash_name)
    chunk = block_hashes(chunk_cache=INFO)
    assert chunk == block_hashes(chunk_cache=INFO), "same structure, shared blocks"
    for salt in (None, OLD_MARKER, str(chunk[0]), "vllm-ascend-chunk"):
        ordinary = block_hashes(cache_salt=salt)
        assert not set(ordinary) & set(chunk), f"salt {salt!r} shares chunk-path blocks"


def test_chunk_structure_and_salt_both_namespace_blocks():
    block_hashes = hasher("sha256_cbor")
    chunk = block_hashes(chunk_cache=INFO)
    salted = block_hashes(chunk_cache=INFO, cache_salt="tenant")
    other = block_hashes(chunk_cache=ChunkSpans(sys_len=5, chunk_lens=[9, 20], question_len=6))
    assert len({chunk[0], salted[0], other[0]}) == 3


def test_a_qattn_request_shares_its_blocks_with_no_one():
    """Its blocks are rewritten while it runs, with what its own question chose."""
    from vllm_ascend_chunk.core.request_info import ChunkCacheInfo

    block_hashes = hasher("sha256_cbor")
    keys = {"sys_hash": b"s", "chunk_hashes": [b"a", b"b"]}
    qattn = ChunkCacheInfo(**msgspec.structs.asdict(INFO), **keys, fraction=0.2, runs=16)
    plain = ChunkCacheInfo(**msgspec.structs.asdict(INFO), **keys)
    mine = block_hashes("q1", chunk_cache=qattn)
    assert mine == block_hashes("q1", chunk_cache=qattn)
    assert block_hashes("q1", chunk_cache=plain) == block_hashes("q2", chunk_cache=plain)
    others = block_hashes("q2", chunk_cache=qattn) + block_hashes("q1", chunk_cache=plain)
    assert not set(mine) & set(others)
