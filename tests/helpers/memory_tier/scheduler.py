"""MemoryTier: the test-only memory tier, the scheduler's side (`tiers.base.Tier`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from vllm_ascend_chunk.scheduler.manager import Entry
from vllm_ascend_chunk.tiers.base import Fill, Kept, TierOwner

NAME = "memory"


@dataclass
class MemoryJobs:
    keep: list[tuple[bytes, list[int]]] = field(default_factory=list)
    """(key, pool rows) of entries evicted: copied out at the start of the step."""
    fill: list[tuple[int, bytes, list[int]]] = field(default_factory=list)
    """(fill id, key, pool rows) of entries to fill: copied in at the end of the step."""


class MemoryTier:
    name = NAME

    def __init__(self, owner: TierOwner, ranks: int = 1) -> None:
        """`owner`: the pool index that offers it keys and whose fills it ends; `ranks`: the
        workers, every one of which must report a fill."""
        self.owner = owner
        self.ranks = ranks
        self.copies: dict[bytes, int] = {}
        """Key → tokens of each entry stored (evicted from the pool) and not cleared."""
        self.filling: list[Entry] = []
        """Entries this tier fills, in the order the fills started."""
        self.hits = self.hit_tokens = self.failures = 0
        self._ids = itertools.count()
        self._by_id: dict[int, Entry] = {}
        self._votes: dict[int, dict[int, bool]] = {}
        self._jobs = MemoryJobs()

    def hold(self, key: bytes) -> None:
        pass

    def prepare_load(self, entry: Entry) -> Fill:
        if entry.key not in self.copies:
            return Fill.ABSENT
        assert self.copies[entry.key] == entry.num_tokens, "one key, one length"
        fill_id = next(self._ids)
        self._by_id[fill_id] = entry
        self.filling.append(entry)
        self._jobs.fill.append((fill_id, entry.key, self._rows(entry)))
        return Fill.LATER

    def loaded(self, entry: Entry, tokens: int, ok: bool) -> None:
        self.failures += not ok
        if tokens:
            self.hits += 1
            self.hit_tokens += tokens

    def prepare_store(self, entry: Entry, why: Kept) -> None:
        if why is Kept.EVICTED:
            self.copies[entry.key] = entry.num_tokens
            self._jobs.keep.append((entry.key, self._rows(entry)))

    def take_jobs(self) -> MemoryJobs | None:
        jobs, self._jobs = self._jobs, MemoryJobs()
        return jobs if jobs.keep or jobs.fill else None

    def reported(self, reports: dict[int, dict[int, bool]]) -> None:
        for rank, fills in reports.items():
            for fill_id, ok in fills.items():
                votes = self._votes.setdefault(fill_id, {})
                votes[rank] = ok
                if len(votes) == self.ranks:
                    del self._votes[fill_id]
                    self._end(self._by_id.pop(fill_id), all(votes.values()))

    def clear(self) -> None:
        self.copies.clear()

    def gauges(self) -> dict[str, float]:
        return {"memory_entries": len(self.copies)}

    def finish(self, index: int, ok: bool) -> Entry:
        """End the `index`-th fill in flight, as its workers would (if it failed while held: the
        owner's `refills`)."""
        entry = self.filling[index]
        self._by_id = {i: e for i, e in self._by_id.items() if e is not entry}
        self._end(entry, ok)
        return entry

    def _end(self, entry: Entry, ok: bool) -> None:
        self.filling.remove(entry)
        self.owner.fetched(entry, ok)

    def _rows(self, entry: Entry) -> list[int]:
        return entry.rows(self.owner.page_size)
