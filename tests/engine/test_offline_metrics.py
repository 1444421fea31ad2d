"""Chunk cache statistics of the shared offline engine: vLLM's periodic log line, the Python API's
hits and misses."""

from __future__ import annotations

from harness import chunk_cases as cc
from tests.unit.test_metrics import payload
from vllm_ascend_chunk.metrics import chunk_cache_metrics


def test_periodic_log_line_has_hit_rate_and_pool_usage(tiny_llama_llm, monkeypatch):
    """vLLM's own stats logger, fed a chunk cache payload, logs it after the throughput line."""
    from vllm.v1.metrics import loggers
    from vllm.v1.metrics.stats import SchedulerStats

    lines = []

    def capture(msg, *args):
        lines.append(msg % args)

    monkeypatch.setattr(loggers.logger, "info", capture)
    monkeypatch.setattr(loggers.logger, "debug", capture)
    stat_logger = loggers.LoggingStatLogger(tiny_llama_llm.llm_engine.vllm_config)
    stat_logger.record(SchedulerStats(kv_connector_stats=payload(hits=9, misses=1, usage=0.5)), None)
    stat_logger.log()
    assert any("Engine 000: Avg prompt throughput" in line for line in lines)
    assert (
        "KV Transfer metrics: chunk_hits=9, host_hits=0, remote_hits=0, chunk_misses=1, "
        "chunk_hit_rate=90.0%, chunk_prefills=0, evictions=0, pool_usage=50.0%, host_usage=0.0%, "
        "remote_errors=0, pinned_entries=0"
    ) in lines


def test_offline_api_counts_hits_and_misses(tiny_llama_llm):
    from vllm import SamplingParams

    docs = [cc.document(700 + i, 40) for i in range(3)]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    before = chunk_cache_metrics(tiny_llama_llm)
    tiny_llama_llm.generate([cc.chunked(cc.SYS, docs, "Which ferry?")], params, use_tqdm=False)
    cold = chunk_cache_metrics(tiny_llama_llm)
    tiny_llama_llm.generate([cc.chunked(cc.SYS, docs[::-1], "Which ferry?")], params, use_tqdm=False)
    warm = chunk_cache_metrics(tiny_llama_llm)
    assert (cold.hit_count - before.hit_count, cold.miss_count - before.miss_count) == (0, 3)
    assert cold.chunk_prefills - before.chunk_prefills == 3
    assert (warm.hit_count - cold.hit_count, warm.miss_count - cold.miss_count) == (3, 0)
    assert warm.hit_tokens - cold.hit_tokens == cold.miss_tokens - before.miss_tokens > 0
    assert warm.pinned_entries == 0 and 0 < warm.usage_ratio < 1 and warm.entries >= 4
    assert 0 < warm.hit_rate <= 1
