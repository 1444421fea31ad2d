"""RemoteReads: the remote store behind the `tiers.base.Tier` interface, the scheduler's side.

A missing key is read from the store while the workers say it is reachable (`Fill.LATER`: the
entry is FETCHING until every worker rank has reported the read, in whichever later steps each
ends it; sent with the next step, `take_jobs`). The requests that need the entry wait meanwhile
(`ChunkCacheCoordinator.get_num_new_matched_tokens`); every other request keeps being scheduled.
The reads not reported yet, the ranks' word on each, and on the store's state, are kept here. An entry whose
read failed is computed instead (`ChunkCacheManager.refills`). Entries reach the store by their
chunk prefills' writes (`ChunkPrefills.saves`), so an evicted entry is not stored again.
"""

from __future__ import annotations

import itertools
import logging

from vllm_ascend_chunk.core.paging import PagedEntry
from vllm_ascend_chunk.core.step import ChunkCacheWorkerMetadata, RemoteRead
from vllm_ascend_chunk.tiers.base import Fill, TierJobs, TierOwner

logger = logging.getLogger("vllm.chunk_cache")


class RemoteReads:
    def __init__(self, manager: TierOwner, enabled: bool, ranks: int = 1) -> None:
        """With a remote store configured (`enabled`), joins `manager`'s tiers; `ranks`: the
        engine's worker ranks (tensor x pipeline parallel), each of which reads its shard."""
        self.manager = manager
        self.stats = manager.stats
        self.enabled = enabled
        """A remote store is configured: computed entries are written to it, missing ones read."""
        self.reachable = enabled
        """Whether missing keys are asked of the store before they are computed."""
        if enabled:
            manager.add_tier(self)
        self.ranks = ranks
        self.in_flight: dict[int, PagedEntry] = {}
        """Reads planned and not reported by every rank yet, by `RemoteRead.read_id`."""
        self._votes: dict[int, dict[int, bool]] = {}
        """`RemoteRead.read_id` → rank → whether that rank's shard arrived, for the reads some
        ranks have reported (an entry is read only if every rank's shard arrived)."""
        self._unsent: list[RemoteRead] = []
        """Reads planned for the step being built."""
        self.counters: dict[int, dict[str, int]] = {}
        """Latest remote-store counters of each worker."""
        self.up: dict[int, bool] = {}
        """Latest remote-store state of each worker: a rank's report counts until it reports
        again (a worker reports only changes); the store is up only if every rank says so."""
        self._ids = itertools.count()

    # -- the Tier interface ----------------------------------------------------------------
    def hold(self, key: bytes) -> None:
        pass

    def prepare_load(self, entry: PagedEntry) -> Fill:
        if not self.reachable:
            return Fill.ABSENT
        self.stats.remote_reads += 1
        read = RemoteRead(read_id=next(self._ids), key=entry.key, rows=entry.rows(self.manager.page_size))
        self.in_flight[read.read_id] = entry
        self._unsent.append(read)
        return Fill.LATER

    def loaded(self, entry: PagedEntry, tokens: int, ok: bool) -> None:
        self.stats.remote_read_failures += not ok
        if tokens:
            self.stats.remote_hits += 1
            self.stats.remote_hit_tokens += tokens

    def prepare_store(self, entry: PagedEntry) -> None:
        pass

    def take_jobs(self, jobs: TierJobs) -> None:
        jobs.remote_reads += self._unsent
        self._unsent = []

    def clear(self) -> None:
        pass

    def gauges(self) -> dict[str, float]:
        return {"remote_up": int(self.reachable)}

    def reported(self, report: ChunkCacheWorkerMetadata) -> None:
        """The workers' report of a step: the store's state and counters, the reads that ranks
        ended (a read ends when the last rank reports it)."""
        if report.remote_up:
            self.up.update(report.remote_up)
            up = all(self.up.values())
            if up != self.reachable:
                logger.info(
                    "Chunk Cache: remote store %s",
                    "reachable: missing entries are read from it again"
                    if up
                    else "unreachable: missing entries are computed until it is back",
                )
                self.reachable = up
        if report.remote_counters:
            self.counters.update(report.remote_counters)
            self.stats.sum_remote_counters(self.counters.values())
        for rank, reads in report.reads.items():
            for read_id, ok in reads.items():
                votes = self._votes.setdefault(read_id, {})
                votes[rank] = ok
                if len(votes) == self.ranks:
                    del self._votes[read_id]
                    self.manager.fetched(self.in_flight.pop(read_id), all(votes.values()))
