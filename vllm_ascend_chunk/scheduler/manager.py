"""ChunkCacheManager: the pool index — which key lives in which pool pages, pins, LRU, stats.

Pure bookkeeping (no vLLM, no tensors). Entries are created *pending* when a chunk prefill is
planned and become *resident* once that prefill has run; only resident, unpinned entries are
evicted, least recently used first, when space is needed or usage exceeds the LRU threshold.
A request acquires all its entries at once or nothing, so requests that hold pins always
progress and the pool never deadlocks.

A cache reset (`clear`) drops every entry from the index at once; an entry that is still pinned
or still being computed keeps its pages until that ends (`dropped`), so no page is handed out
while a prefill may still write into it or a request may still load from it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vllm_ascend_chunk.paging import pages_for, slot_of


@dataclass(eq=False)
class Entry:
    key: bytes
    num_tokens: int
    pages: list[int]
    resident: bool = False
    pins: int = 0
    dropped: bool = False
    """Removed from the index by a reset while pinned or pending; its pages are freed once
    it is neither (`ChunkCacheManager.settle`)."""

    def rows(self, page_size: int) -> list[int]:
        """Pool rows of the entry's tokens, in token order."""
        return [slot_of(self.pages, page_size, t) for t in range(self.num_tokens)]


def _counter(doc: str) -> int:
    """A `ChunkCacheStats` counter: starts at 0; `doc` is also its Prometheus help text."""
    return field(default=0, metadata={"doc": doc})


@dataclass
class ChunkCacheStats:
    """Running totals since the engine started. Every field is a counter that the stats log,
    Prometheus (`vllm:chunk_cache_<field>_total`) and the Python API report (`metrics`)."""

    hits: int = _counter("Chunk occurrences found resident in the pool when a request was planned.")
    misses: int = _counter("Chunk occurrences not resident (computed, or joined a prefill in flight).")
    hit_tokens: int = _counter("Tokens of the chunk hits (loaded from the pool instead of computed).")
    miss_tokens: int = _counter("Tokens of the chunk misses.")
    inflight_joins: int = _counter("Misses served by a chunk prefill another request had already started.")
    evictions: int = _counter("Pool entries evicted (least recently used first).")
    chunk_prefills: int = _counter("Chunk prefills run to compute missing chunks (SYS + chunk).")


@dataclass
class Acquired:
    """What `ChunkCacheManager.acquire` pinned for one request."""

    entries: list[Entry]
    """One entry per requested key, in request order (duplicates share an entry)."""
    created: list[Entry] = field(default_factory=list)
    """Pending entries created by this call: the caller must have them computed."""


class ChunkCacheManager:
    def __init__(self, num_pages: int, page_size: int, lru_threshold: float) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.lru_threshold = lru_threshold
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self.stats = ChunkCacheStats()

    # -- queries ---------------------------------------------------------------------------
    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self.free_pages)

    @property
    def usage_ratio(self) -> float:
        return self.used_pages / self.num_pages if self.num_pages else 0.0

    @property
    def pinned_entries(self) -> int:
        return sum(1 for e in self.entries.values() if e.pins)

    # -- acquire / release -----------------------------------------------------------------
    def missing_pages(self, needs: Sequence[tuple[bytes, int]]) -> int:
        """Pages that acquiring `needs` would take for keys not in the pool yet."""
        missing = {k: n for k, n in needs if k not in self.entries}
        return sum(pages_for(n, self.page_size) for n in missing.values())

    def acquire(
        self, needs: Sequence[tuple[bytes, int]], chunk_keys: set[bytes], count: bool = True
    ) -> Acquired | None:
        """Pin an entry for every (key, num_tokens); missing keys get new pending entries.

        Returns None, changing nothing, when the pool cannot make room right now.
        `chunk_keys` says which keys count as chunks in the hit/miss statistics (`count`: whether
        this acquisition is counted at all; a request planned again is not).
        """
        missing = {k: n for k, n in needs if k not in self.entries}
        if not self._make_room(self.missing_pages(needs), protect={k for k, _ in needs}):
            return None
        created = [self._create(k, n) for k, n in missing.items()]
        if count:
            self._count(needs, chunk_keys, created)
        entries = [self.entries[k] for k, _ in needs]
        for entry in {id(e): e for e in entries}.values():
            entry.pins += 1
            self.entries.move_to_end(entry.key)
        self._evict_over_threshold()
        return Acquired(entries=entries, created=created)

    def _count(
        self, needs: Sequence[tuple[bytes, int]], chunk_keys: set[bytes], created: Sequence[Entry]
    ) -> None:
        for key, num_tokens in needs:
            if key not in chunk_keys:
                continue
            entry = self.entries[key]
            if entry.resident:
                self.stats.hits += 1
                self.stats.hit_tokens += num_tokens
            else:
                self.stats.misses += 1
                self.stats.miss_tokens += num_tokens
                self.stats.inflight_joins += entry not in created

    def release(self, entries: Iterable[Entry]) -> None:
        for entry in {id(e): e for e in entries}.values():
            assert entry.pins > 0, f"entry {entry.key.hex()[:12]} released more often than pinned"
            entry.pins -= 1
            self.settle(entry)
        self._evict_over_threshold()

    def mark_resident(self, entry: Entry) -> None:
        """The prefill of a pending entry completed: its rows hold the entry's K/V."""
        entry.resident = True
        self.settle(entry)

    def discard(self, entry: Entry) -> None:
        """Forget a pending entry whose prefill did not complete (callers release its pins first)."""
        assert not entry.resident and not entry.pins, "only unpinned pending entries are discarded"
        if self.entries.get(entry.key) is entry:
            self._free(entry)
        elif entry.dropped:
            self._reclaim(entry)

    def clear(self) -> int:
        """Drop every entry (a cache reset): from now on every key misses. Pages of an entry still
        pinned or pending stay taken until it settles. Returns how many entries were dropped."""
        entries = list(self.entries.values())
        self.entries.clear()
        for entry in entries:
            entry.dropped = True
            self.settle(entry)
        return len(entries)

    def settle(self, entry: Entry) -> None:
        """Free the pages of a dropped entry nobody can read or write any more."""
        if entry.dropped and entry.resident and not entry.pins:
            self._reclaim(entry)

    # -- mechanics -------------------------------------------------------------------------
    def _create(self, key: bytes, num_tokens: int) -> Entry:
        pages = [self.free_pages.pop() for _ in range(pages_for(num_tokens, self.page_size))]
        entry = self.entries[key] = Entry(key=key, num_tokens=num_tokens, pages=pages)
        return entry

    def _free(self, entry: Entry) -> None:
        del self.entries[entry.key]
        self.free_pages.extend(reversed(entry.pages))

    def _reclaim(self, entry: Entry) -> None:
        """Give back the pages of a dropped entry (once: its page list is emptied)."""
        self.free_pages.extend(reversed(entry.pages))
        entry.pages = []

    def _evictable(self, protect: set[bytes] = frozenset()) -> Iterable[Entry]:
        return [e for e in self.entries.values() if e.resident and not e.pins and e.key not in protect]

    def _make_room(self, pages: int, protect: set[bytes]) -> bool:
        shortfall = pages - len(self.free_pages)
        if shortfall <= 0:
            return True
        victims, freed = [], 0
        for entry in self._evictable(protect):
            if freed >= shortfall:
                break
            victims.append(entry)
            freed += len(entry.pages)
        if freed < shortfall:
            return False
        for entry in victims:
            self._evict(entry)
        return True

    def _evict_over_threshold(self) -> None:
        limit = self.lru_threshold * self.num_pages
        for entry in self._evictable():
            if self.used_pages <= limit:
                break
            self._evict(entry)

    def _evict(self, entry: Entry) -> None:
        self._free(entry)
        self.stats.evictions += 1
