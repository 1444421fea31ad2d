"""ChunkCacheManager: the pool index — which key lives in which pool pages, pins, LRU, stats —
and the plan across the tiers below the pool.

Pure bookkeeping (no vLLM, no tensors); the pages and their LRU order are `paging.PageIndex`'s.
Entries are created *pending* when a chunk prefill is planned and become *resident* once that
prefill has run (`EntryState` lists every state and what moves an entry between them); only
resident, unpinned entries are evicted, least recently used first, when space is needed or usage
exceeds the LRU threshold.
A request acquires all its entries at once or nothing, so requests that hold pins always
progress and the pool never deadlocks.

Tiers (`docs/design/design.md`, Tiers; `tiers.base`). A key missing from the pool is offered to
each of `tiers` in order: the host-memory tier fills the new entry with the step's row copies
(resident at once), the remote store by a read that its workers start with the next step and end
in whichever later step it arrives, or as a miss after `VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S` (the
entry is FETCHING until every rank has reported the read: `fetched`); otherwise it is computed.
An entry a chunk prefill completed (`computed`) and one evicted from the pool are offered to every
tier (`Tier.prepare_store`). The host tier's copies are jobs that the worker runs at the start of
the next step, host writes before host reads, before anything else touches the pool; so a page
freed here and reused at once is only overwritten after its old content has been copied out.

A cache reset (`clear`) drops every entry from the index at once; an entry that is still pinned
or still being computed or read keeps its pages until that ends (a DROPPED_ state), so no page is
handed out while a prefill or a read may still write into it or a request may still load from it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_ascend_chunk.core.paging import PagedEntry, PageIndex, pages_for
from vllm_ascend_chunk.core.stats import ChunkCacheStats
from vllm_ascend_chunk.tiers.base import Fill, Kept, Tier

if TYPE_CHECKING:
    from vllm_ascend_chunk.core.step import ChunkCacheWorkerMetadata


class EntryState(enum.Enum):
    """Where a pool entry stands. Transitions, by the `ChunkCacheManager` method that makes them:

    - `acquire` creates a missing key's entry RESIDENT (a tier fills it with the step: the host
      tier), FETCHING (a tier fills it in a later step: the remote store) or COMPUTING (a chunk
      prefill fills it).
    - `fetched`: FETCHING → RESIDENT if the fill brought the entry; otherwise → COMPUTING while a
      request holds it (it joins `refills`: the coordinator has it computed), else → FREED.
      DROPPED_FETCHING → DROPPED_RESIDENT (→ FREED if unpinned), or → FREED if the fill failed.
    - `mark_resident` (its prefill completed): COMPUTING → RESIDENT; DROPPED_COMPUTING →
      DROPPED_RESIDENT, → FREED at once if unpinned.
    - `discard` (its prefill did not complete): COMPUTING or DROPPED_COMPUTING → FREED.
    - `acquire` and `release` (eviction, to make room or over the LRU threshold): RESIDENT and
      unpinned → FREED, offered to the tiers first.
    - `clear` (a reset): COMPUTING → DROPPED_COMPUTING, FETCHING → DROPPED_FETCHING, RESIDENT →
      DROPPED_RESIDENT if pinned, else → FREED.
    - `release` of the last pin: DROPPED_RESIDENT → FREED.
    """

    COMPUTING = "computing"
    """In the index, pending: a chunk prefill computes it (or will, once a tier's fill failed)."""
    FETCHING = "fetching"
    """In the index, pending on an asynchronous fill from a tier (a remote store's read)."""
    RESIDENT = "resident"
    """In the index, its rows hold its K/V: loadable; evictable once unpinned."""
    DROPPED_COMPUTING = "dropped computing"
    """Removed from the index by a reset; keeps its pages until its prefill ends."""
    DROPPED_FETCHING = "dropped fetching"
    """Removed from the index by a reset; keeps its pages until its fill ends."""
    DROPPED_RESIDENT = "dropped resident"
    """Removed from the index by a reset; keeps its pages until its last pin goes."""
    FREED = "freed"
    """Its pages were given back (evicted, discarded, or dropped and settled); final."""


_DROPPED = {
    EntryState.COMPUTING: EntryState.DROPPED_COMPUTING,
    EntryState.FETCHING: EntryState.DROPPED_FETCHING,
    EntryState.RESIDENT: EntryState.DROPPED_RESIDENT,
}
"""The state of an indexed entry → its state once a reset dropped it."""


@dataclass(eq=False)
class Entry(PagedEntry):
    """A pool entry: its `rows` are pool rows."""

    state: EntryState = EntryState.COMPUTING
    """The one record of where it stands (`resident`, `fetching` and `dropped` read it)."""
    pins: int = 0
    source: Tier | None = None
    """The tier filling it asynchronously (FETCHING), if any."""
    fetch_tokens: int = 0
    """Chunk tokens to count as a hit of `source` or a miss once the fill ends (0: not counted)."""

    @property
    def resident(self) -> bool:
        """Its rows hold its K/V (RESIDENT or DROPPED_RESIDENT)."""
        return self.state in (EntryState.RESIDENT, EntryState.DROPPED_RESIDENT)

    @property
    def fetching(self) -> bool:
        """Pending on a tier's asynchronous fill (FETCHING or DROPPED_FETCHING)."""
        return self.state in (EntryState.FETCHING, EntryState.DROPPED_FETCHING)

    @property
    def dropped(self) -> bool:
        """Removed from the index by a reset and not freed yet (a DROPPED_ state)."""
        return self.state in _DROPPED.values()


@dataclass
class Acquired:
    """What `ChunkCacheManager.acquire` pinned for one request."""

    entries: list[Entry]
    """One entry per requested key, in request order (duplicates share an entry)."""
    created: list[Entry] = field(default_factory=list)
    """Pending entries created by this call that the caller must have computed."""
    fetches: list[Entry] = field(default_factory=list)
    """Pending entries created by this call that their tier fills asynchronously (`source`)."""
    filled: dict[bytes, Tier] = field(default_factory=dict)
    """Keys of the entries created by this call that a tier filled with the step."""


class ChunkCacheManager(PageIndex[Entry]):
    def __init__(self, num_pages: int, page_size: int, lru_threshold: float) -> None:
        super().__init__(num_pages, page_size)
        self.lru_threshold = lru_threshold
        self.stats = ChunkCacheStats()
        self.tiers: list[Tier] = []
        """The tiers below the pool, in the order a missing key is offered to them (`add_tier`)."""
        self.refills: list[Entry] = []
        """Entries whose fill failed while a request held them: to be computed (`take_refills`)."""

    def add_tier(self, tier: Tier) -> None:
        """`tier` is asked for missing keys after the tiers added before it."""
        self.tiers.append(tier)

    # -- queries ---------------------------------------------------------------------------
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

        Returns None when the pool cannot make room right now: the pool and the tiers' LRU orders
        are then unchanged, but the tiers still hold their copies of the missing keys for the step
        being built (`Tier.hold`: the host tier keeps them from eviction until the step is sent).
        A copy a new entry is filled from is marked recently used by its tier
        (`Tier.prepare_load`).
        `chunk_keys` says which keys count as chunks in the hit/miss statistics (`count`: whether
        this acquisition is counted at all; a request planned again is not).
        """
        missing = {k: n for k, n in needs if k not in self.entries}
        for tier in self.tiers:  # copies to fill from are kept while room is made for them
            for key in missing:
                tier.hold(key)
        if not self._make_room(self.missing_pages(needs), protect={k for k, _ in needs}):
            return None
        acquired = Acquired(entries=[])
        for key, num_tokens in missing.items():
            self._create(key, num_tokens, acquired)
        if count:
            self._count(needs, chunk_keys, acquired)
        acquired.entries = [self.entries[k] for k, _ in needs]
        for entry in {id(e): e for e in acquired.entries}.values():
            entry.pins += 1
            self.entries.move_to_end(entry.key)
        self._evict_over_threshold()
        return acquired

    def _count(self, needs: Sequence[tuple[bytes, int]], chunk_keys: set[bytes], acquired: Acquired) -> None:
        stats = self.stats
        for key, num_tokens in needs:
            if key not in chunk_keys:
                continue
            entry = self.entries[key]
            if key in acquired.filled:
                acquired.filled[key].loaded(entry, num_tokens, ok=True)
            elif entry in acquired.fetches:
                entry.fetch_tokens += num_tokens
            elif entry.resident:
                stats.hits += 1
                stats.hit_tokens += num_tokens
            else:
                stats.misses += 1
                stats.miss_tokens += num_tokens
                stats.inflight_joins += entry not in acquired.created

    def fetched(self, entry: Entry, ok: bool) -> None:
        """The asynchronous fill of a fetching entry ended: resident if `ok`; if not, computed
        while a request still holds it (`refills`), else freed."""
        assert entry.fetching and entry.source is not None, f"entry {entry.key.hex()[:12]} was not being read"
        # The fill ended: pending as if a prefill computed it, until it is resident or freed below.
        entry.state = EntryState.DROPPED_COMPUTING if entry.dropped else EntryState.COMPUTING
        entry.source.loaded(entry, entry.fetch_tokens if ok else 0, ok)
        if entry.fetch_tokens and not ok:
            self.stats.misses += 1
            self.stats.miss_tokens += entry.fetch_tokens
        if ok:
            self.mark_resident(entry)
        elif entry.pins and not entry.dropped:
            self.refills.append(entry)
        else:
            self.discard(entry)

    def take_refills(self) -> list[Entry]:
        """The entries whose fill failed while held, since the last call: compute them."""
        refills, self.refills = self.refills, []
        return refills

    def tier(self, name: str) -> Tier | None:
        """The tier called `name` (`Tier.name`), if the engine has it."""
        return next((t for t in self.tiers if t.name == name), None)

    def computed(self, entries: Iterable[Entry]) -> None:
        """The step being built saves the last tokens of `entries`: offered to every tier."""
        for entry in entries:
            for tier in self.tiers:
                tier.prepare_store(entry, Kept.COMPUTED)

    def take_jobs(self) -> dict[str, object]:
        """What the tiers ask of the workers since the last call, for the step being built, by
        tier name; the copies they read or write may be replaced from now on."""
        return {tier.name: jobs for tier in self.tiers if (jobs := tier.take_jobs()) is not None}

    def reported(self, report: ChunkCacheWorkerMetadata) -> None:
        """The workers' report of a step, to each tier it has news of (the fills it ends: `fetched`)."""
        for tier in self.tiers:
            if reports := report.tiers.get(tier.name):
                tier.reported(reports)

    def release(self, entries: Iterable[Entry]) -> None:
        for entry in {id(e): e for e in entries}.values():
            assert entry.pins > 0, f"entry {entry.key.hex()[:12]} released more often than pinned"
            entry.pins -= 1
            self.settle(entry)
        self._evict_over_threshold()

    def mark_resident(self, entry: Entry) -> None:
        """The prefill of a pending entry completed: its rows hold the entry's K/V."""
        assert entry.state in (EntryState.COMPUTING, EntryState.DROPPED_COMPUTING), (
            f"entry {entry.key.hex()[:12]} is {entry.state.value}, not being computed"
        )
        entry.state = EntryState.DROPPED_RESIDENT if entry.dropped else EntryState.RESIDENT
        self.settle(entry)

    def discard(self, entry: Entry) -> None:
        """Forget a pending entry whose prefill did not complete (callers release its pins first);
        nothing if it was freed already."""
        assert not entry.resident and not entry.pins, "only unpinned pending entries are discarded"
        if entry.state is not EntryState.FREED:
            self._free(entry)

    def clear(self) -> int:
        """Drop every entry, and every tier's copies (a cache reset): from now on every key misses.
        Pages of an entry still pinned or pending stay taken until it settles. Returns how many
        pool entries were dropped."""
        entries = list(self.entries.values())
        self.entries.clear()
        for entry in entries:
            entry.state = _DROPPED[entry.state]
            self.settle(entry)
        for tier in self.tiers:
            tier.clear()
        return len(entries)

    def settle(self, entry: Entry) -> None:
        """Free the pages of a dropped entry nobody can read or write any more."""
        if entry.state is EntryState.DROPPED_RESIDENT and not entry.pins:
            self._free(entry)

    # -- mechanics -------------------------------------------------------------------------
    def _create(self, key: bytes, num_tokens: int, acquired: Acquired) -> None:
        """A new entry for `key`, filled by the first tier that has it, else computed."""
        pages = self._take_pages(pages_for(num_tokens, self.page_size))
        entry = self.entries[key] = Entry(key=key, num_tokens=num_tokens, pages=pages)
        for tier in self.tiers:
            fill = tier.prepare_load(entry)
            if fill is Fill.NOW:
                entry.state = EntryState.RESIDENT
                acquired.filled[key] = tier
                return
            if fill is Fill.LATER:
                entry.state, entry.source = EntryState.FETCHING, tier
                acquired.fetches.append(entry)
                return
        acquired.created.append(entry)

    def _free(self, entry: Entry) -> None:
        """→ FREED: its pages are given back (and it leaves the index, unless a reset dropped it)."""
        if entry.dropped:
            self._give_back(entry)
        else:
            super()._free(entry)
        entry.state = EntryState.FREED

    def _evictable(self, protect: set[bytes] = frozenset()) -> Iterator[Entry]:
        """Resident, unpinned entries not in `protect`, least recently used first."""
        return (
            e
            for e in self.entries.values()
            if e.state is EntryState.RESIDENT and not e.pins and e.key not in protect
        )

    def _make_room(self, pages: int, protect: set[bytes]) -> bool:
        victims = self._lru_victims(self._evictable(protect), pages)
        if victims is None:
            return False
        for entry in victims:
            self._evict(entry)
        return True

    def _evict_over_threshold(self) -> None:
        limit = self.lru_threshold * self.num_pages
        for entry in list(self._evictable()):
            if self.used_pages <= limit:
                break
            self._evict(entry)

    def _evict(self, entry: Entry) -> None:
        for tier in self.tiers:
            tier.prepare_store(entry, Kept.EVICTED)
        self._free(entry)
        self.stats.evictions += 1
