"""The scheduler's side of the remote store: the reads sent to the workers and not reported yet,
those that failed (their entries computed instead), and the workers' word on the store's state.
The entries themselves (FETCHING, then resident or pending) are the manager's."""

from __future__ import annotations

import itertools
import logging

from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager, Entry
from vllm_ascend_chunk.step import ChunkCacheWorkerMetadata, RemoteRead

logger = logging.getLogger("vllm.chunk_cache")


class RemoteReads:
    def __init__(self, manager: ChunkCacheManager, enabled: bool) -> None:
        self.manager = manager
        self.enabled = enabled
        """A remote store is configured: computed entries are written to it, missing ones read."""
        manager.remote_reachable = enabled
        self.in_flight: dict[int, Entry] = {}
        """Reads sent to the workers and not reported yet, by `RemoteRead.read_id`."""
        self.failed: list[Entry] = []
        """Entries whose read failed: computed from the next `plan` if a request still holds them."""
        self.counters: dict[int, dict[str, int]] = {}
        """Latest remote-store counters of each worker."""
        self.up: dict[int, bool] = {}
        """Latest remote-store state of each worker: a rank's report counts until it reports
        again (a worker reports only changes); the store is up only if every rank says so."""
        self._ids = itertools.count()

    def send(self, entry: Entry, rows: list[int]) -> RemoteRead:
        """A read of `entry` into its pool `rows`, for the step being built."""
        read = RemoteRead(read_id=next(self._ids), key=entry.key, rows=rows)
        self.in_flight[read.read_id] = entry
        return read

    def reported(self, report: ChunkCacheWorkerMetadata) -> None:
        """The workers' report of a step: the store's state and counters, the reads that ended."""
        if report.remote_up and self.enabled:
            self.up.update(report.remote_up)
            up = all(self.up.values())
            if up != self.manager.remote_reachable:
                logger.info(
                    "Chunk Cache: remote store %s",
                    "reachable: missing entries are read from it again"
                    if up
                    else "unreachable: missing entries are computed until it is back",
                )
                self.manager.remote_reachable = up
        if report.remote_counters:
            self.counters.update(report.remote_counters)
            self.manager.stats.sum_remote_counters(self.counters.values())
        for read_id, ok in report.reads.items():
            entry = self.in_flight.pop(read_id)
            if self.manager.fetched(entry, ok):
                self.failed.append(entry)

    def take_failed(self) -> list[Entry]:
        """The entries whose read failed since the last call."""
        failed, self.failed = self.failed, []
        return failed
