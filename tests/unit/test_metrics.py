"""Chunk cache statistics without an engine: Prometheus metrics of two engines in a private
registry, the stats log's totals, the offline API's refusal without stats. With an engine:
tests/engine/test_offline_metrics.py; through `vllm serve`: tests/server/test_metrics.py."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_ascend_chunk.core.stats import REASONS, ChunkCacheStats, reason_field
from vllm_ascend_chunk.metrics import (
    COUNTERS,
    GAUGES,
    INCREMENTS,
    REASON_FIELDS,
    ChunkCacheConnectorStats,
    ChunkCacheMetrics,
    ChunkCachePromMetrics,
    chunk_cache_metrics,
)
from vllm_ascend_chunk.tiers.mooncake.store_stats import RemoteStoreStats

LABELS = ["model_name", "engine"]


def payload(hits=0, misses=0, usage=0.0, entries=0, pinned=0, since=None, **counters) -> dict:
    """A scheduler payload with these totals; its increments count from the totals of `since`."""
    data = dict.fromkeys([*COUNTERS, *REASON_FIELDS], 0) | dict.fromkeys(GAUGES, 0) | counters
    data |= {
        "hits": hits,
        "misses": misses,
        "usage_ratio": usage,
        "entries": entries,
        "pinned_entries": pinned,
    }
    increments = {name: data[name] - (since or {}).get(name, 0) for name in [*COUNTERS, *REASON_FIELDS]}
    return data | {INCREMENTS: increments}


@pytest.fixture
def prom():
    """Prometheus metrics of two engines in a private registry."""
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = ChunkCachePromMetrics(config, types, LABELS, {0: ["m", "0"], 1: ["m", "1"]})
    return metrics, registry


def scrape(registry) -> ChunkCacheMetrics:
    return ChunkCacheMetrics.from_prometheus_text(generate_latest(registry).decode())


def test_prometheus_counters_add_the_increments_per_engine(prom):
    metrics, registry = prom
    first = payload(hits=2, misses=3, hit_tokens=40, usage=0.25, entries=3, pinned=1)
    metrics.observe(first, 0)
    metrics.observe(payload(hits=2, misses=3, hit_tokens=40, usage=0.25, entries=3, pinned=1, since=first), 0)
    metrics.observe(payload(hits=5, misses=3, hit_tokens=90, usage=0.5, entries=3, since=first), 0)
    metrics.observe(payload(hits=1, misses=1, chunk_prefills=1, usage=0.1, entries=1), 1)
    m = scrape(registry)
    assert (m.hit_count, m.miss_count, m.hit_tokens, m.chunk_prefills) == (6, 4, 90, 1)
    assert (m.entries, m.pinned_entries) == (4, 0)
    assert m.usage_ratio == pytest.approx(0.3)  # the mean over engines
    assert m.hit_rate == pytest.approx(0.6)
    text = generate_latest(registry).decode()
    assert 'vllm:chunk_cache_hits_total{engine="0",model_name="m"} 5.0' in text


def test_the_coverage_histogram_observes_each_payload_s_values(prom):
    metrics, registry = prom
    metrics.observe(payload(coverage=[0.55, 1.0], cover_fallbacks=1), 0)
    metrics.observe(payload(coverage=[0.95]), 1)
    text = generate_latest(registry).decode()
    assert 'vllm:chunk_cache_coverage_bucket{engine="0",le="0.6",model_name="m"} 1.0' in text
    assert 'vllm:chunk_cache_coverage_count{engine="0",model_name="m"} 2.0' in text
    assert 'vllm:chunk_cache_coverage_bucket{engine="1",le="0.95",model_name="m"} 1.0' in text
    assert scrape(registry).cover_fallbacks == 1


def test_scrape_without_chunk_metrics_says_why():
    with pytest.raises(LookupError, match="chunk cache enabled"):
        ChunkCacheMetrics.from_prometheus_text("vllm:num_requests_running 0.0\n")


def test_log_stats_keep_the_latest_totals():
    stats = ChunkCacheConnectorStats(data={})
    assert stats.is_empty()
    stats = ChunkCacheConnectorStats(data=payload(hits=1, misses=1))
    stats = stats.aggregate(
        ChunkCacheConnectorStats(
            data=payload(
                hits=3, misses=2, usage=0.125, pinned=2, chunk_prefills=1, host_hits=1, remote_hits=2
            )
        )
    )
    assert not stats.is_empty()
    assert stats.reduce() == {
        "chunk_hits": 3,
        "host_hits": 1,
        "remote_hits": 2,
        "chunk_misses": 2,
        "chunk_hit_rate": "75.0%",
        "chunk_prefills": 1,
        "evictions": 0,
        "pool_usage": "12.5%",
        "host_usage": "0.0%",
        "remote_errors": 0,
        "pinned_entries": 2,
    }


def test_offline_api_needs_stats_logging():
    no_stats = SimpleNamespace(llm_engine=SimpleNamespace(log_stats=False))
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        chunk_cache_metrics(no_stats)


def test_the_remote_counters_sum_the_workers_by_reason(prom):
    """Each worker's `RemoteStore.stats` counters reach Prometheus summed over the workers, the
    read misses and write drops under a `reason` label (totals: the sum over it)."""
    workers = [
        dataclasses.asdict(RemoteStoreStats(timeouts=2, absent=1, put_queue_full=3, get_errors=1)),
        dataclasses.asdict(RemoteStoreStats(timeouts=1, put_store_full=1, put_errors=2, rejected=1)),
    ]
    stats = ChunkCacheStats()
    stats.sum_remote_counters(workers)
    assert (stats.remote_read_misses, stats.remote_read_misses_timeout, stats.remote_read_misses_error) == (
        5,
        3,
        1,
    )
    assert (stats.remote_write_drops, stats.remote_write_drops_queue_full) == (4, 3)
    assert (stats.remote_errors, stats.remote_rejected) == (3, 1)
    metrics, registry = prom
    metrics.observe(payload(**dataclasses.asdict(stats)), 0)
    text = generate_latest(registry).decode()
    assert 'vllm:chunk_cache_remote_read_misses_total{engine="0",model_name="m",reason="timeout"} 3.0' in text
    assert (
        'vllm:chunk_cache_remote_write_drops_total{engine="0",model_name="m",reason="store_full"} 1.0' in text
    )
    m = scrape(registry)
    assert (m.remote_read_misses, m.remote_write_drops, m.remote_errors) == (5, 4, 3)
    assert m.remote_reasons["remote_read_misses"] == {
        "absent": 1,
        "incomplete": 0,
        "timeout": 3,
        "dropped": 0,
        "store_down": 0,
        "error": 1,
    }
    assert m.remote_reasons["remote_write_drops"]["queue_full"] == 3


def test_every_reason_has_its_field_and_its_worker_counter():
    fields = {f.name for f in dataclasses.fields(ChunkCacheStats)}
    worker = {f.name for f in dataclasses.fields(RemoteStoreStats)}
    for name, reasons in REASONS.items():
        assert name in COUNTERS
        assert {reason_field(name, r) for r in reasons} <= fields
        assert set(reasons.values()) <= worker, name
