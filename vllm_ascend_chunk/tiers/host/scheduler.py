"""HostTier: the host-memory tier behind the `tiers.base.Tier` interface.

Entries evicted from the pool are copied into host rows (`HostIndex` says which), and a missing
key found there is copied back with the step being built (`Fill.NOW`). The copies are
`HostJobs` the worker runs at the start of the step, host writes before host reads
(`tiers.host.worker.HostCopies`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_ascend_chunk.core.paging import PagedEntry
from vllm_ascend_chunk.core.stats import ChunkCacheStats
from vllm_ascend_chunk.tiers.base import Fill, Kept
from vllm_ascend_chunk.tiers.host.index import HostIndex

NAME = "host"


@dataclass
class HostJobs:
    """A step's row copies between the device pool and host memory (every write before every read)."""

    write_from: list[int] = field(default_factory=list)
    """Device-pool rows copied into host memory ..."""
    write_to: list[int] = field(default_factory=list)
    """... at these host rows (entries evicted from the pool)."""
    read_from: list[int] = field(default_factory=list)
    """Host rows copied into the device pool ..."""
    read_to: list[int] = field(default_factory=list)
    """... at these pool rows (entries found in the host tier)."""


class HostTier:
    name = NAME

    def __init__(self, num_pages: int, page_size: int, stats: ChunkCacheStats, token_bytes: int = 0) -> None:
        self.index = HostIndex(num_pages, page_size)
        self.stats = stats
        self.token_bytes = token_bytes
        """Bytes of one token's K/V in every layer (for the byte counters)."""
        self._jobs = HostJobs()

    def hold(self, key: bytes) -> None:
        self.index.hold(key)

    def prepare_load(self, entry: PagedEntry) -> Fill:
        copy = self.index.hold(entry.key)  # read in this step
        if copy is None:
            return Fill.ABSENT
        self.index.touch(entry.key)  # a hit: most recently used
        self._jobs.read_from += copy.rows(self.index.page_size)
        self._jobs.read_to += entry.rows(self.index.page_size)
        self.stats.host_bytes_read += entry.num_tokens * self.token_bytes
        return Fill.NOW

    def loaded(self, entry: PagedEntry, tokens: int, ok: bool) -> None:
        if tokens:
            self.stats.host_hits += 1
            self.stats.host_hit_tokens += tokens

    def prepare_store(self, entry: PagedEntry, why: Kept) -> None:
        if why is not Kept.EVICTED:
            return
        if self.index.touch(entry.key):  # still there since it was copied back
            return
        copy = self.index.store(entry.key, entry.num_tokens)
        self.stats.host_evictions = self.index.evictions
        if copy is not None:
            self._jobs.write_from += entry.rows(self.index.page_size)
            self._jobs.write_to += copy.rows(self.index.page_size)
            self.stats.host_bytes_written += entry.num_tokens * self.token_bytes

    def take_jobs(self) -> HostJobs | None:
        planned, self._jobs = self._jobs, HostJobs()
        self.index.end_step()
        return planned if planned.write_from or planned.read_from else None

    def reported(self, reports: dict) -> None:
        pass

    def clear(self) -> None:
        self.index.clear()

    def gauges(self) -> dict[str, float]:
        return {"host_usage_ratio": self.index.usage_ratio, "host_entries": len(self.index.entries)}
