"""Chunk cache statistics through `vllm serve`: `/metrics` counts a cold request's misses and a warm
one's hits. Without a server: tests/unit/test_metrics.py (Prometheus, the stats log) and
tests/engine/test_offline_metrics.py (the periodic log line, the offline Python API)."""

from __future__ import annotations

import dataclasses

from harness import chunk_cases as cc
from tests.helpers import server_utils
from vllm_ascend_chunk.metrics import ChunkCacheMetrics

LABELS = ["model_name", "engine"]


def _delta(now, before):
    """How much a metric moved; by label for the counters by reason (`remote_reasons`)."""
    if isinstance(now, dict):
        return {k: _delta(v, before.get(k, {} if isinstance(v, dict) else 0)) for k, v in now.items()}
    return now - before


def test_server_metrics_endpoint(tiny_llama_server):
    """`/metrics` of a real `vllm serve` shows a cold request's misses, then a warm one's hits."""
    client = server_utils.client(tiny_llama_server)
    docs = [cc.document(720 + i, 30) for i in range(2)]

    def ask(order) -> ChunkCacheMetrics:
        before = server_utils.metrics(tiny_llama_server)
        client.completions.create(
            model="tiny-llama", prompt=cc.chunked(cc.SYS, order, "Why?"), max_tokens=2, temperature=0
        )
        seen = before.hit_count + before.miss_count
        now = server_utils.wait_metrics(tiny_llama_server, lambda m: m.hit_count + m.miss_count >= seen + 2)
        return ChunkCacheMetrics(
            **{
                f.name: _delta(getattr(now, f.name), getattr(before, f.name))
                for f in dataclasses.fields(ChunkCacheMetrics)
            }
        )

    assert ask(docs).miss_count == 2
    delta = ask(docs[::-1])
    assert (delta.hit_count, delta.miss_count, delta.chunk_prefills) == (2, 0, 0)
    assert server_utils.metrics(tiny_llama_server).pinned_entries == 0
