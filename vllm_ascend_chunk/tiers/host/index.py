"""HostIndex: which key's copy lives in which pages of the host-memory tier.

Pure bookkeeping on the same `paging.PageIndex` as the pool index (`scheduler.manager`). The
host tier holds copies of entries evicted from the device pool, least recently used evicted first
when it is full. An entry is complete once its copy is scheduled (the worker runs a step's copies
into host memory before the copies out of it), so it has no pending state. A copy held (to be
read: `hold`) or written in the step being built is *busy* until the step's operations are sent
(`end_step`): its pages are not given to another entry in the same step, so one step never reads
host rows that it also overwrites, nor writes the same host rows twice (one `index_copy_` with
duplicate rows has no defined winner). Holding a copy leaves the LRU order as it is; `touch` makes
a copy most recently used, where it is really used (copied back into the pool).
"""

from __future__ import annotations

from vllm_ascend_chunk.core.paging import PagedEntry, PageIndex, pages_for


class HostEntry(PagedEntry):
    """A copy in the host tier; its `rows` are host rows."""


class HostIndex(PageIndex[HostEntry]):
    """The host tier's copies by key, least recently used first, and the copies busy in the step."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self.busy: set[bytes] = set()
        """Keys held or written in the step being built."""
        self.retired: list[HostEntry] = []
        """Busy copies dropped by `clear`: their pages are free once the step is sent."""
        self.evictions = 0

    def hold(self, key: bytes) -> HostEntry | None:
        """The copy of `key`, busy for this step (kept, and its pages not given to another copy,
        until the step is sent), its place in the LRU order unchanged (`touch`); None if absent."""
        entry = self.entries.get(key)
        if entry is not None:
            self.busy.add(key)
        return entry

    def touch(self, key: bytes) -> bool:
        """Mark the copy of `key` most recently used; False if there is none."""
        if key not in self.entries:
            return False
        self.entries.move_to_end(key)
        return True

    def store(self, key: bytes, num_tokens: int) -> HostEntry | None:
        """Pages for a new copy of `key` (busy for this step), evicting least recently used copies
        that are not busy; None (nothing changed) if they cannot be made free. The key must not
        be stored yet."""
        needed = pages_for(num_tokens, self.page_size)
        replaceable = (e for e in self.entries.values() if e.key not in self.busy)
        victims = self._lru_victims(replaceable, needed)
        if victims is None:
            return None
        for entry in victims:
            self._free(entry)
            self.evictions += 1
        entry = self.entries[key] = HostEntry(key=key, num_tokens=num_tokens, pages=self._take_pages(needed))
        self.busy.add(key)
        return entry

    def end_step(self) -> None:
        """The step's operations were sent: copies read or written in it may be replaced now."""
        self.busy.clear()
        for entry in self.retired:
            self._give_back(entry)
        self.retired.clear()

    def clear(self) -> None:
        """Drop every copy (a cache reset); pages the step being built reads or writes stay
        taken until it is sent."""
        for entry in list(self.entries.values()):
            if entry.key in self.busy:
                del self.entries[entry.key]
                self.retired.append(entry)
            else:
                self._free(entry)
