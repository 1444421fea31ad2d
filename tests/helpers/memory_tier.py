"""A tier for tests only, to show that a backend is one class behind `tiers.base.Tier`:
the keys of evicted entries in a dict (no K/V: the manager's bookkeeping is what is tested),
each fill asynchronous (`Fill.LATER`) and ended by the test (`finish`), as a remote store's read
is ended by the workers' report."""

from __future__ import annotations

from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager, Entry
from vllm_ascend_chunk.tiers.base import Fill, TierJobs


class MemoryTier:
    def __init__(self) -> None:
        self.copies: dict[bytes, int] = {}
        """Key → tokens of each entry stored (evicted from the pool) and not cleared."""
        self.filling: list[Entry] = []
        """Entries this tier fills, in the order the fills started; `finish` ends them."""
        self.hits = self.hit_tokens = self.failures = 0

    def hold(self, key: bytes) -> None:
        pass

    def prepare_load(self, entry: Entry) -> Fill:
        if entry.key not in self.copies:
            return Fill.ABSENT
        assert self.copies[entry.key] == entry.num_tokens, "one key, one length"
        self.filling.append(entry)
        return Fill.LATER

    def loaded(self, entry: Entry, tokens: int, ok: bool) -> None:
        self.failures += not ok
        if tokens:
            self.hits += 1
            self.hit_tokens += tokens

    def prepare_store(self, entry: Entry) -> None:
        self.copies[entry.key] = entry.num_tokens

    def take_jobs(self, jobs: TierJobs) -> None:
        pass

    def reported(self, report) -> None:
        pass

    def clear(self) -> None:
        self.copies.clear()

    def gauges(self) -> dict[str, float]:
        return {"memory_entries": len(self.copies)}

    def finish(self, manager: ChunkCacheManager, index: int, ok: bool) -> Entry:
        """End the `index`-th fill in flight (if it failed while held: `manager.refills`)."""
        entry = self.filling.pop(index)
        manager.fetched(entry, ok)
        return entry
