"""ChunkCacheManager without an engine: pages, pins, LRU, in-flight joins, resets."""

from __future__ import annotations

from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager


def make(num_pages: int = 8, page_size: int = 4, threshold: float = 1.0) -> ChunkCacheManager:
    return ChunkCacheManager(num_pages, page_size, threshold)


def used_pages(m: ChunkCacheManager) -> set[int]:
    return {p for e in m.entries.values() for p in e.pages}


def test_acquire_creates_pending_entries_in_whole_pages():
    m = make()
    got = m.acquire([(b"s", 3), (b"a", 5)], chunk_keys={b"a"})
    assert [e.num_tokens for e in got.entries] == [3, 5]
    assert got.created == got.entries and not any(e.resident for e in got.entries)
    assert [len(e.pages) for e in got.entries] == [1, 2] and m.used_pages == 3
    assert (m.stats.misses, m.stats.miss_tokens, m.stats.hits) == (1, 5, 0)


def test_second_acquire_of_a_pending_key_is_an_inflight_join_then_a_hit():
    m = make()
    first = m.acquire([(b"a", 4)], chunk_keys={b"a"})
    joined = m.acquire([(b"a", 4)], chunk_keys={b"a"})
    assert joined.created == [] and joined.entries[0] is first.entries[0]
    assert (m.stats.misses, m.stats.inflight_joins) == (2, 1) and first.entries[0].pins == 2
    m.mark_resident(first.entries[0])
    m.acquire([(b"a", 4)], chunk_keys={b"a"}, count=True)
    assert (m.stats.hits, m.stats.hit_tokens) == (1, 4)
    m.acquire([(b"a", 4)], chunk_keys={b"a"}, count=False)
    assert m.stats.hits == 1


def test_duplicate_keys_share_one_entry_and_one_pin():
    m = make()
    got = m.acquire([(b"a", 4), (b"a", 4)], chunk_keys={b"a"})
    assert got.entries[0] is got.entries[1] and got.entries[0].pins == 1 and m.used_pages == 1


def test_full_pool_evicts_least_recently_used_unpinned_resident_entries():
    m = make(num_pages=3)
    for key in (b"a", b"b", b"c"):
        entry = m.acquire([(key, 4)], chunk_keys={key}).entries[0]
        m.mark_resident(entry)
        m.release([entry])
    m.acquire([(b"a", 4)], chunk_keys={b"a"})  # a becomes the most recently used, pinned
    got = m.acquire([(b"d", 8)], chunk_keys={b"d"})
    assert got is not None and set(m.entries) == {b"a", b"d"} and m.stats.evictions == 2


def test_pinned_or_pending_entries_are_never_evicted():
    m = make(num_pages=2)
    pinned = m.acquire([(b"a", 4)], chunk_keys={b"a"}).entries[0]
    m.mark_resident(pinned)
    m.acquire([(b"b", 4)], chunk_keys={b"b"})  # pending
    pages_before = m.free_pages.copy()
    assert m.acquire([(b"c", 4)], chunk_keys={b"c"}) is None
    assert m.free_pages == pages_before and set(m.entries) == {b"a", b"b"} and m.stats.misses == 2


def test_threshold_evicts_after_release():
    m = make(num_pages=4, threshold=0.5)
    entries = []
    for key in (b"a", b"b", b"c"):
        entries.append(m.acquire([(key, 4)], chunk_keys={key}).entries[0])
        m.mark_resident(entries[-1])
    assert m.used_pages == 3  # pinned: nothing can go
    m.release(entries)
    assert m.used_pages == 2 and set(m.entries) == {b"b", b"c"}


def test_missing_pages_counts_only_unknown_keys():
    m = make()
    m.acquire([(b"a", 4)], chunk_keys={b"a"})
    assert m.missing_pages([(b"a", 4), (b"b", 5), (b"c", 1)]) == 3


def test_clear_keeps_pages_of_pending_entries_until_their_prefill_ends():
    """A reset while a chunk prefill still writes into its rows must not hand those pages out."""
    m = make(num_pages=2)
    pending = m.acquire([(b"a", 8)], chunk_keys={b"a"}).entries[0]
    m.release([pending])  # its request was aborted; the prefill goes on
    assert m.clear() == 1 and m.entries == {}
    assert m.free_pages == [] and m.used_pages == 2
    assert m.acquire([(b"b", 4)], chunk_keys={b"b"}) is None  # no page of the orphan is reused
    m.mark_resident(pending)  # the prefill ended: its pages come back, the entry stays gone
    assert m.used_pages == 0 and b"a" not in m.entries
    assert m.acquire([(b"b", 4)], chunk_keys={b"b"}) is not None


def test_clear_frees_a_pinned_entry_when_its_last_pin_goes():
    m = make(num_pages=2)
    entry = m.acquire([(b"a", 4)], chunk_keys={b"a"}).entries[0]
    m.mark_resident(entry)
    m.clear()
    assert m.used_pages == 1
    m.release([entry])
    assert m.used_pages == 0 and m.entries == {}


def test_discard_of_a_dropped_pending_entry_frees_it_once():
    m = make(num_pages=2)
    entry = m.acquire([(b"a", 4)], chunk_keys={b"a"}).entries[0]
    m.release([entry])
    m.clear()
    m.discard(entry)
    m.discard(entry)
    assert sorted(m.free_pages) == [0, 1]
