"""RemoteStoreTier: the remote store behind the `tiers.base.Tier` interface, the scheduler's side.

A missing key is read from the store while the workers say it is reachable (`Fill.LATER`: the
entry is FETCHING until every worker rank has reported the read, in whichever later steps each
ends it; sent with the next step, `take_jobs`: `RemoteJobs`). The requests that need the entry wait meanwhile
(`ChunkCacheCoordinator.get_num_new_matched_tokens`); every other request keeps being scheduled.
The reads not reported yet, the ranks' word on each, and on the store's state, are kept here. An entry whose
read failed is computed instead (`ChunkCacheManager.refills`). An entry is written to the store
after the step whose saves completed it (`prepare_store`, `Kept.COMPUTED`); an evicted entry is
not written again.
"""

from __future__ import annotations

import itertools
import logging

from vllm_ascend_chunk.core.paging import PagedEntry
from vllm_ascend_chunk.tiers.base import Fill, Kept, TierOwner
from vllm_ascend_chunk.tiers.mooncake.jobs import NAME, RemoteJobs, RemoteRead, RemoteReport, RemoteWrite

logger = logging.getLogger("vllm.chunk_cache")


class RemoteStoreTier:
    name = NAME

    def __init__(self, manager: TierOwner, ranks: int = 1) -> None:
        """The store's tier under `manager` (which adds it); `ranks`: the engine's worker ranks
        (tensor x pipeline parallel), each of which reads and writes its shard."""
        self.manager = manager
        self.stats = manager.stats
        self.reachable = True
        """Whether missing keys are asked of the store before they are computed."""
        self.ranks = ranks
        self.in_flight: dict[int, PagedEntry] = {}
        """Reads planned and not reported by every rank yet, by `RemoteRead.read_id`."""
        self._votes: dict[int, dict[int, bool]] = {}
        """`RemoteRead.read_id` → rank → whether that rank's shard arrived, for the reads some
        ranks have reported (an entry is read only if every rank's shard arrived)."""
        self._unsent = RemoteJobs()
        """Reads and writes planned for the step being built."""
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
        self._unsent.reads.append(read)
        return Fill.LATER

    def loaded(self, entry: PagedEntry, tokens: int, ok: bool) -> None:
        self.stats.remote_read_failures += not ok
        if tokens:
            self.stats.remote_hits += 1
            self.stats.remote_hit_tokens += tokens

    def prepare_store(self, entry: PagedEntry, why: Kept) -> None:
        # An entry dropped by a reset may hold K/V of replaced weights: not shared.
        if why is Kept.COMPUTED and not entry.dropped:
            self._unsent.writes.append(RemoteWrite(entry.key, entry.rows(self.manager.page_size)))

    def take_jobs(self) -> RemoteJobs | None:
        jobs, self._unsent = self._unsent, RemoteJobs()
        return jobs if jobs.reads or jobs.writes else None

    def clear(self) -> None:
        pass

    def gauges(self) -> dict[str, float]:
        return {"remote_up": int(self.reachable)}

    def reported(self, reports: dict[int, RemoteReport]) -> None:
        """Its workers' reports of a step: the store's state and counters, the reads that ranks
        ended (a read ends when the last rank reports it)."""
        self.up.update({rank: r.up for rank, r in reports.items() if r.up is not None})
        up = all(self.up.values())
        if up != self.reachable:
            logger.info(
                "Chunk Cache: remote store %s",
                "reachable: missing entries are read from it again"
                if up
                else "unreachable: missing entries are computed until it is back",
            )
            self.reachable = up
        counters = {rank: r.counters for rank, r in reports.items() if r.counters is not None}
        if counters:
            self.counters.update(counters)
            self.stats.sum_remote_counters(self.counters.values())
        for rank, report in reports.items():
            for read_id, ok in report.reads.items():
                votes = self._votes.setdefault(read_id, {})
                votes[rank] = ok
                if len(votes) == self.ranks:
                    del self._votes[read_id]
                    self.manager.fetched(self.in_flight.pop(read_id), all(votes.values()))
