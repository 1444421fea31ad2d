"""Chunk cache statistics: engine core -> vLLM's stat loggers -> log line, Prometheus, Python API.

The `SchedulerStats` of a step with outputs carries a payload in its `kv_connector_stats` slot,
the place vLLM keeps for the configured KV connector's statistics: the running totals of the
counters (the log line), their increments since the last payload (the Prometheus counters) and
the current gauges. vLLM sends a step's stats to one frontend of the engine, and with several API
servers (`--data-parallel-size`, `--api-server-count`) each one counts what it receives: only
increments add up there. vLLM's offline engine drops the stats of a step without outputs (all
hidden chunk prefills), so the scheduler sends no payload with such a step and its increments
ride with the next one (`vllm_adapter.scheduler`). vLLM hands the payload to the
connector class: `build_kv_connector_stats` feeds its periodic stats log ("KV Transfer metrics:
..." after the engine's throughput line), `build_prom_metrics` the Prometheus metrics on
`/metrics` (and `LLM.get_metrics()`). `chunk_cache_metrics` reads them back for offline use.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_ascend_chunk.core.stats import REASONS, ChunkCacheStats, reason_field
from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager
from vllm_ascend_chunk.tiers.registry import tier_gauges

PREFIX = "vllm:chunk_cache_"

COUNTERS = {f.name: f.metadata["doc"] for f in dataclasses.fields(ChunkCacheStats) if "doc" in f.metadata}
"""Counter name → help text: the counter fields of `ChunkCacheStats`. Those of `REASONS` carry a
`reason` label, whose values are counted by their reason fields (`REASON_FIELDS`)."""
REASON_FIELDS = [reason_field(counter, reason) for counter, reasons in REASONS.items() for reason in reasons]
"""The `ChunkCacheStats` fields that count one reason of a counter of `REASONS`."""
HISTOGRAMS = {
    f.name: f.metadata["histogram"] for f in dataclasses.fields(ChunkCacheStats) if "histogram" in f.metadata
}
"""Histogram name → help text: the observation fields of `ChunkCacheStats`."""
FRACTION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)
"""Bucket bounds of the histograms (every one observes a fraction in [0, 1])."""
GAUGES = {
    "usage_ratio": "Fraction of the chunk pool's pages in use (0..1).",
    "entries": "Entries in the pool (resident or being computed).",
    "pinned_entries": "Entries pinned by requests in flight.",
    **tier_gauges(),
}
"""Gauge name → help text: the pool's, and every tier backend's (`tiers.registry`)."""


INCREMENTS = "increments"
"""Payload key of the counters' increments since the last payload a frontend received."""


def stats_payload(manager: ChunkCacheManager, delivered: dict[str, int] | None = None) -> dict[str, Any]:
    """The manager's counter totals, their increments over `delivered` (the totals of the last
    payload a frontend received), the histograms' observations not yet delivered
    (`forget_delivered` drops them once delivered) and the tiers' gauges, as sent with a
    `SchedulerStats`."""
    data: dict[str, Any] = dataclasses.asdict(manager.stats)
    delivered = delivered or {}
    data[INCREMENTS] = {name: data[name] - delivered.get(name, 0) for name in [*COUNTERS, *REASON_FIELDS]}
    data.update(
        usage_ratio=manager.usage_ratio,
        entries=len(manager.entries),
        pinned_entries=manager.pinned_entries,
    )
    data.update(dict.fromkeys(tier_gauges(), 0))  # the gauges of tiers the engine does not have
    for tier in manager.tiers:
        data.update(tier.gauges())
    return data


def forget_delivered(manager: ChunkCacheManager, payload: dict[str, Any]) -> None:
    """`payload` reached a frontend: its histogram observations are not sent again."""
    for name in HISTOGRAMS:
        del getattr(manager.stats, name)[: len(payload.get(name, ()))]


def _hit_rate(hits: float, misses: float) -> float | None:
    """Hits over chunk occurrences; None before the first occurrence."""
    return hits / (hits + misses) if hits + misses else None


def _all_hits(data: dict[str, Any]) -> int:
    """Chunk occurrences served by any tier (device pool, host memory, remote store)."""
    return sum(data.get(name, 0) for name in ("hits", "host_hits", "remote_hits"))


class ChunkCacheConnectorStats(KVConnectorStats):
    """The latest payload of a logging interval (every payload holds totals)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = dict(other.data)
        return self

    def reduce(self) -> dict[str, int | float | str]:
        d = self.data
        rate = _hit_rate(_all_hits(d), d["misses"])
        return {
            "chunk_hits": d["hits"],
            "host_hits": d["host_hits"],
            "remote_hits": d["remote_hits"],
            "chunk_misses": d["misses"],
            "chunk_hit_rate": "-" if rate is None else f"{100 * rate:.1f}%",
            "chunk_prefills": d["chunk_prefills"],
            "evictions": d["evictions"],
            "pool_usage": f"{100 * d['usage_ratio']:.1f}%",
            "host_usage": f"{100 * d['host_usage_ratio']:.1f}%",
            "remote_errors": d["remote_errors"],
            "pinned_entries": d["pinned_entries"],
        }

    def is_empty(self) -> bool:
        return not (_all_hits(self.data) or self.data.get("misses"))


class ChunkCachePromMetrics(KVConnectorPromMetrics):
    """`vllm:chunk_cache_*` counters and gauges, one child per engine (counters follow the totals)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
            if name not in REASONS
        }
        self.reason_counters = {}
        """`reason_field` → its child of the counter's `reason` label, per engine."""
        for name, reasons in REASONS.items():
            counter = self._counter_cls(
                name=PREFIX + name, documentation=COUNTERS[name], labelnames=[*labelnames, "reason"]
            )
            for reason in reasons:
                self.reason_counters[reason_field(name, reason)] = {
                    engine: counter.labels(*values, reason)
                    for engine, values in per_engine_labelvalues.items()
                }
        self.gauges = {
            name: create_metric_per_engine(
                self._gauge_cls(
                    name=PREFIX + name,
                    documentation=doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                ),
                per_engine_labelvalues,
            )
            for name, doc in GAUGES.items()
        }
        self.histograms = {
            name: create_metric_per_engine(
                self._histogram_cls(
                    name=PREFIX + name, documentation=doc, labelnames=labelnames, buckets=FRACTION_BUCKETS
                ),
                per_engine_labelvalues,
            )
            for name, doc in HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        increments = transfer_stats_data.get(INCREMENTS, {})
        for name, per_engine in (self.counters | self.reason_counters).items():
            if (n := increments.get(name, 0)) > 0:
                per_engine[engine_idx].inc(n)
        for name, per_engine in self.histograms.items():
            for value in transfer_stats_data.get(name, ()):
                per_engine[engine_idx].observe(value)
        for name, per_engine in self.gauges.items():
            if name in transfer_stats_data:
                per_engine[engine_idx].set(transfer_stats_data[name])


_API_NAMES = {"hits": "hit_count", "misses": "miss_count"}
"""The `ChunkCacheMetrics` field of each counter whose name differs from it."""


@dataclasses.dataclass(frozen=True)
class ChunkCacheMetrics:
    """The chunk cache's counters since the engine started and its current pool state."""

    hit_count: int
    """Chunk occurrences found in the device pool."""
    miss_count: int
    hit_tokens: int
    miss_tokens: int
    inflight_joins: int
    evictions: int
    chunk_prefills: int
    external_loads: int
    external_load_tokens: int
    selections: int
    selected_tokens: int
    cover_fallbacks: int
    batched_runs: int
    host_hits: int
    host_hit_tokens: int
    remote_hits: int
    remote_hit_tokens: int
    host_bytes_written: int
    host_bytes_read: int
    host_evictions: int
    remote_reads: int
    remote_read_failures: int
    remote_bytes_read: int
    remote_bytes_written: int
    remote_errors: int
    remote_corrupt: int
    remote_rejected: int
    remote_read_misses: int
    """A worker's reads that brought no object (every worker); by reason in `remote_reasons`."""
    remote_write_drops: int
    usage_ratio: float
    entries: int
    pinned_entries: int
    host_usage_ratio: float
    host_entries: int
    remote_up: bool
    remote_reasons: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    """`remote_read_misses` and `remote_write_drops` by reason (`core.stats.REASONS`)."""

    @property
    def hit_rate(self) -> float:
        """Occurrences served by any tier over all chunk occurrences (0.0 before the first)."""
        hits = self.hit_count + self.host_hits + self.remote_hits
        return _hit_rate(hits, self.miss_count) or 0.0

    @classmethod
    def from_samples(cls, samples: Iterable[tuple[str, Mapping[str, str], float]]) -> ChunkCacheMetrics:
        """From (metric name, labels, value), one per engine (and reason); counters may carry
        `_total`."""
        values: dict[str, list[float]] = defaultdict(list)
        for name, labels, value in samples:
            if name.startswith(PREFIX):
                name = name.removeprefix(PREFIX).removesuffix("_total")
                values[name].append(value)
                if name in REASONS and labels.get("reason") in REASONS[name]:
                    values[reason_field(name, labels["reason"])].append(value)
        if not values:
            raise LookupError(
                "no vllm:chunk_cache_* metrics: is the chunk cache enabled in this "
                "engine, and has it run a step since it started?"
            )
        counters = {_API_NAMES.get(name, name): int(sum(values[name])) for name in COUNTERS}
        return cls(
            **counters,
            usage_ratio=_mean(values["usage_ratio"]),
            entries=int(sum(values["entries"])),
            pinned_entries=int(sum(values["pinned_entries"])),
            host_usage_ratio=_mean(values["host_usage_ratio"]),
            host_entries=int(sum(values["host_entries"])),
            remote_up=bool(values["remote_up"]) and all(values["remote_up"]),
            remote_reasons={
                name: {reason: int(sum(values[reason_field(name, reason)])) for reason in reasons}
                for name, reasons in REASONS.items()
            },
        )

    @classmethod
    def from_prometheus_text(cls, text: str) -> ChunkCacheMetrics:
        """From a `/metrics` scrape of a `vllm serve` process."""
        from prometheus_client.parser import text_string_to_metric_families

        return cls.from_samples(
            (s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if not s.name.endswith("_created")
        )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def chunk_cache_metrics(llm) -> ChunkCacheMetrics:
    """The chunk cache metrics of an offline `vllm.LLM` (created with `disable_log_stats=False`)."""
    if not llm.llm_engine.log_stats:
        raise ValueError(
            "chunk cache metrics need stats logging: create the LLM with disable_log_stats=False"
        )
    return ChunkCacheMetrics.from_samples(
        (m.name, m.labels, m.value) for m in llm.get_metrics() if hasattr(m, "value")
    )
