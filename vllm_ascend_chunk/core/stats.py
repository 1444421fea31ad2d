"""ChunkCacheStats: the chunk cache's counters, with the Prometheus help text of each, and the
workers' remote-store counters they sum (`metrics.py` reports them)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

REMOTE_COUNTERS = {
    "remote_bytes_read": ("bytes_read",),
    "remote_bytes_written": ("bytes_written",),
    "remote_errors": ("get_errors", "get_store_down", "put_errors"),
    "remote_corrupt": ("corrupt",),
    "remote_rejected": ("rejected",),
}
"""`ChunkCacheStats` field → the `RemoteStore.stats` counters of every worker it sums."""
REASONS = {
    "remote_read_misses": {
        "absent": "absent",
        "incomplete": "incomplete",
        "timeout": "timeouts",
        "dropped": "get_drops",
        "store_down": "get_store_down",
        "error": "get_errors",
    },
    "remote_write_drops": {
        "queue_full": "put_queue_full",
        "store_down": "put_store_down",
        "store_full": "put_store_full",
        "encode_error": "put_encode_errors",
    },
}
"""A counter with a `reason` label → reason → the `RemoteStore.stats` counter of every worker
it sums. `ChunkCacheStats` holds the total and a field per reason (`reason_field`)."""


def reason_field(counter: str, reason: str) -> str:
    """The `ChunkCacheStats` field of one reason of a counter of `REASONS`."""
    return f"{counter}_{reason}"


def _counter(doc: str) -> int:
    """A `ChunkCacheStats` counter: starts at 0; `doc` is also its Prometheus help text."""
    return field(default=0, metadata={"doc": doc})


def _reason(counter: str, reason: str) -> int:
    """A `ChunkCacheStats` counter: `counter`'s count for `reason` (`REASONS`)."""
    return field(default=0, metadata={"reason_of": counter, "reason": reason})


def _observations(doc: str) -> list[float]:
    """A `ChunkCacheStats` histogram: the values observed and not yet delivered to a frontend
    (`metrics.stats_payload`); `doc` is also its Prometheus help text."""
    return field(default_factory=list, metadata={"histogram": doc})


@dataclass
class ChunkCacheStats:
    """Running totals since the engine started. Every field but the histograms is a counter that
    the stats log, Prometheus (`vllm:chunk_cache_<field>_total`) and the Python API report
    (`metrics`); those of `REASONS` carry a `reason` label, counted by their reason fields (the
    total is their sum). A histogram (`vllm:chunk_cache_<field>`) holds its observations until a
    frontend receives them."""

    hits: int = _counter("Chunk occurrences found resident in the device pool when a request was planned.")
    misses: int = _counter(
        "Chunk occurrences in no tier (computed, or joined a prefill or a remote read in flight)."
    )
    hit_tokens: int = _counter("Tokens of the chunk hits in the device pool (loaded instead of computed).")
    miss_tokens: int = _counter("Tokens of the chunk misses.")
    inflight_joins: int = _counter("Misses served by a prefill or remote read another request had started.")
    evictions: int = _counter("Pool entries evicted (least recently used first).")
    chunk_prefills: int = _counter("Chunk prefills run to compute missing chunks (SYS + chunk).")
    external_loads: int = _counter(
        "Chunked prompts whose KV, chunk region included, another connector loaded (P/D decode)."
    )
    external_load_tokens: int = _counter("Tokens of the chunked prompts another connector loaded.")
    selections: int = _counter(
        "Requests (`qattn` recovery) that recomputed the document tokens their question chose."
    )
    selected_tokens: int = _counter("Document tokens those requests recomputed in place.")
    cover_fallbacks: int = _counter(
        "Requests (`cover` recovery) served with every document computed: their ceiling did not "
        "reach the coverage they asked for, or they could not be scored."
    )
    batched_runs: int = _counter(
        "Runs of those requests computed in the forward of an earlier run of theirs (a batch row each)."
    )
    host_hits: int = _counter("Chunk occurrences copied back from the host-memory tier.")
    host_hit_tokens: int = _counter("Tokens of the host-tier hits.")
    remote_hits: int = _counter("Chunk occurrences read from the remote store.")
    remote_hit_tokens: int = _counter("Tokens of the remote-store hits.")
    host_bytes_written: int = _counter("Bytes copied from the device pool into the host-memory tier.")
    host_bytes_read: int = _counter("Bytes copied from the host-memory tier back into the device pool.")
    host_evictions: int = _counter("Host-tier entries evicted (least recently used first).")
    remote_reads: int = _counter("Entries (SYS or chunk) asked of the remote store.")
    remote_read_failures: int = _counter(
        "Remote reads that brought nothing (absent, corrupt, foreign, store down or slow)."
    )
    remote_bytes_read: int = _counter("Bytes of objects read from the remote store (every worker).")
    remote_bytes_written: int = _counter("Bytes of objects written to the remote store (every worker).")
    remote_errors: int = _counter("Remote store operations that failed (every worker; timeouts are misses).")
    remote_corrupt: int = _counter(
        "Remote objects refused and removed (every worker): without a secret, garbage, truncated or "
        "foreign; with one, objects it verified whose size or checksum is wrong."
    )
    remote_rejected: int = _counter(
        "Remote objects refused and removed because the secret did not sign them for the entry read "
        "(every worker): garbage, unsigned, another key's, forged, altered, another format version's, "
        "or another entry's replayed."
    )
    remote_read_misses: int = _counter(
        "Remote reads of a worker that brought no object (every worker), by reason: absent; "
        "incomplete (a part lost, or parts of two writes); timeout (not read within the timeout of "
        "its start); dropped (given up before it started, or over the read queue); store_down (the "
        "store down); error (the store failed it). Corrupt and rejected objects count on their own."
    )
    remote_write_drops: int = _counter(
        "Remote writes dropped (every worker), by reason: queue_full (the write queue over its byte "
        "bound); store_down (when queued or when written); store_full (Mooncake's no-space answer); "
        "encode_error (K/V that does not match its object's header)."
    )
    # One field per reason of each counter of `REASONS` (its Prometheus `reason` label).
    remote_read_misses_absent: int = _reason("remote_read_misses", "absent")
    remote_read_misses_incomplete: int = _reason("remote_read_misses", "incomplete")
    remote_read_misses_timeout: int = _reason("remote_read_misses", "timeout")
    remote_read_misses_dropped: int = _reason("remote_read_misses", "dropped")
    remote_read_misses_store_down: int = _reason("remote_read_misses", "store_down")
    remote_read_misses_error: int = _reason("remote_read_misses", "error")
    remote_write_drops_queue_full: int = _reason("remote_write_drops", "queue_full")
    remote_write_drops_store_down: int = _reason("remote_write_drops", "store_down")
    remote_write_drops_store_full: int = _reason("remote_write_drops", "store_full")
    remote_write_drops_encode_error: int = _reason("remote_write_drops", "encode_error")
    coverage: list[float] = _observations(
        "Per scored `cover` request: the fraction of its question's attention over the documents "
        "that falls on exact tokens (the first document and the windows it recomputes; at the "
        "ceiling when it falls back)."
    )

    def sum_remote_counters(self, workers: Collection[Mapping[str, int]]) -> None:
        """Set the remote counters to their totals over the workers' latest `RemoteStore.stats`."""
        for field_name, counters in REMOTE_COUNTERS.items():
            setattr(self, field_name, sum(c.get(n, 0) for c in workers for n in counters))
        for field_name, reasons in REASONS.items():
            for reason, counter in reasons.items():
                setattr(self, reason_field(field_name, reason), sum(c.get(counter, 0) for c in workers))
            setattr(self, field_name, sum(getattr(self, reason_field(field_name, r)) for r in reasons))
