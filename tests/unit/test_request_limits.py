"""The operator's limits on one request (`VLLM_CHUNK_CACHE_MAX_DOCS`,
`VLLM_CHUNK_CACHE_MAX_REQUEST_TOKENS`): what counts, and a refusal that names the setting.
Through a server: `tests/server/test_limits.py`."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from vllm_ascend_chunk.config.settings import ChunkCacheConfig, get_config
from vllm_ascend_chunk.core.geometry import PoolGeometry
from vllm_ascend_chunk.core.request_info import ChunkSpans
from vllm_ascend_chunk.frontend.keys import check_fits, check_num_docs, with_keys
from vllm_ascend_chunk.frontend.parser import ChunkPromptError

POOL = PoolGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype=torch.float32, num_pages=64)
"""1,024 tokens of pool in 16-token pages."""


def info(sys_ids: list[int], docs: list[list[int]], question: tuple[int, ...] = (7,)):
    ids = [*sys_ids, *(t for d in docs for t in d), *question]
    spans = ChunkSpans(len(sys_ids), [len(d) for d in docs], len(question))
    return with_keys(spans, ids, ("model",), lambda value: hashlib.sha256(repr(value).encode()).digest())


def test_documents_over_the_limit_are_refused_naming_it():
    check_num_docs(8, 8)
    with pytest.raises(ChunkPromptError) as err:
        check_num_docs(9, 8)
    message = str(err.value)
    assert "brings 9 documents" in message and "VLLM_CHUNK_CACHE_MAX_DOCS=8" in message


def test_the_pool_a_request_holds_counts_distinct_documents_in_whole_pages():
    doc_a, doc_b = list(range(100, 120)), list(range(200, 201))  # 20 tokens: 2 pages; 1 token: 1 page
    same_twice = info([1, 2, 3], [doc_a, doc_b, doc_a, doc_b])  # SYS 1 page + 3 pages = 64 rows
    check_fits(same_twice, POOL, ChunkCacheConfig(max_request_tokens=64))
    with pytest.raises(ChunkPromptError) as err:
        check_fits(same_twice, POOL, ChunkCacheConfig(max_request_tokens=63))
    message = str(err.value)
    assert "need 64 tokens of chunk pool" in message and "16-token pages" in message
    assert "VLLM_CHUNK_CACHE_MAX_REQUEST_TOKENS=63" in message
    assert "VLLM_CHUNK_CACHE_SIZE_GB" not in message


def test_a_request_larger_than_the_pool_names_the_pool_first(chunk_env):
    chunk_env(VLLM_CHUNK_CACHE_SIZE_GB=None)
    tiny_docs = [[1000 + i] for i in range(64)]  # a page each, and a page of SYS: 65 pages
    with pytest.raises(ChunkPromptError, match="holds 1024. .*raise VLLM_CHUNK_CACHE_SIZE_GB"):
        # over the limit too: the pool can never take it
        check_fits(info([1], tiny_docs), POOL, dataclasses.replace(get_config(), max_request_tokens=10))
