"""ChunkCacheManager without an engine: pages, pins, LRU, in-flight joins, resets."""

from __future__ import annotations

from tests.helpers.tier_steps import take_host_jobs
from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager, EntryState
from vllm_ascend_chunk.tiers.host.index import HostIndex
from vllm_ascend_chunk.tiers.host.scheduler import HostTier
from vllm_ascend_chunk.tiers.mooncake.scheduler import RemoteStoreTier


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


def test_entry_states_follow_the_documented_transitions():
    """`EntryState`: computed, evicted; dropped while computing, fetching or pinned; discarded."""
    m = make(num_pages=8)
    remote = RemoteStoreTier(m)
    m.add_tier(remote)
    fetching = m.acquire([(b"f", 4)], chunk_keys={b"f"}).entries[0]
    remote.reachable = False
    computing, pinned, idle, lost = (m.acquire([(k, 4)], chunk_keys={k}).entries[0] for k in b"cpil")
    assert (fetching.state, computing.state) == (EntryState.FETCHING, EntryState.COMPUTING)
    for entry in (pinned, idle):
        m.mark_resident(entry)
    m.release([idle, lost])
    assert (idle.state, idle.resident) == (EntryState.RESIDENT, True)
    m.discard(lost)
    assert lost.state is EntryState.FREED and b"l" not in m.entries
    m.clear()
    assert [e.state for e in (fetching, computing, pinned, idle)] == [
        EntryState.DROPPED_FETCHING,
        EntryState.DROPPED_COMPUTING,
        EntryState.DROPPED_RESIDENT,
        EntryState.FREED,
    ]
    assert fetching.fetching and fetching.dropped and not idle.dropped
    m.fetched(fetching, True)
    assert fetching.state is EntryState.DROPPED_RESIDENT and not m.refills
    m.mark_resident(computing)
    assert computing.state is EntryState.DROPPED_RESIDENT
    m.release([fetching, computing, pinned])
    assert all(e.state is EntryState.FREED for e in (fetching, computing, pinned))
    assert m.used_pages == 0


# -- tiers ---------------------------------------------------------------------------------------
def with_host(num_pages: int, host_pages: int, token_bytes: int = 0) -> tuple[ChunkCacheManager, HostIndex]:
    """A pool of `num_pages` pages of 4 tokens over a host tier of `host_pages`; and the host's index."""
    m = ChunkCacheManager(num_pages, 4, 1.0)
    host = HostTier(host_pages, 4, m.stats, token_bytes)
    m.add_tier(host)
    return m, host.index


def resident(m: ChunkCacheManager, key: bytes, n: int = 4) -> None:
    entry = m.acquire([(key, n)], chunk_keys={key}).entries[0]
    m.mark_resident(entry)
    m.release([entry])


def test_evicted_entries_are_copied_to_the_host_tier_and_copied_back_on_a_miss():
    m, _ = with_host(2, host_pages=4, token_bytes=10)
    resident(m, b"a")
    a_rows = m.entries[b"a"].rows(4)
    resident(m, b"b")
    m.take_jobs()
    resident(m, b"c")  # a is evicted: copied to host memory
    jobs = take_host_jobs(m)
    assert jobs.write_from == a_rows and len(jobs.write_to) == 4 and not jobs.read_from
    assert (m.stats.evictions, m.stats.host_bytes_written) == (1, 40)
    got = m.acquire([(b"a", 4)], chunk_keys={b"a"})  # b goes to host, a comes back
    assert got.created == [] and got.entries[0].resident
    jobs = take_host_jobs(m)
    assert len(jobs.read_from) == 4 and len(jobs.write_from) == 4  # b out, then a in
    assert jobs.read_to == got.entries[0].rows(4)
    assert (m.stats.host_hits, m.stats.host_hit_tokens, m.stats.misses) == (1, 4, 3)


def test_a_host_copy_read_in_the_step_being_built_is_not_replaced_before_it_is_sent():
    m, host = with_host(1, host_pages=1)
    resident(m, b"a")
    resident(m, b"b")  # a → host (its only page)
    m.take_jobs()
    got = m.acquire([(b"a", 4)], chunk_keys={b"a"})  # a read back; b cannot go to host: a is read
    assert got is not None and b"b" not in host.entries and host.entries.keys() == {b"a"}
    m.release(got.entries)
    m.take_jobs()  # the step is sent: a's copy may be replaced now
    resident(m, b"c")  # a leaves the pool: its copy is still in host memory, nothing to copy
    assert not take_host_jobs(m).write_from
    resident(m, b"d")  # c leaves the pool and replaces a's copy
    assert host.entries.keys() == {b"c"} and m.stats.host_evictions == 1


def test_an_acquire_the_pool_cannot_take_leaves_the_host_lru_order_and_reads_only_a_hit():
    """A failed acquire changes no LRU order: it only holds the copies it would read for the step
    being built; the copy a new entry is filled from becomes the most recently used."""
    m, host = with_host(1, host_pages=2)
    for key in (b"a", b"b", b"c"):
        resident(m, key)  # a, then b → host
    m.take_jobs()
    assert list(host.entries) == [b"a", b"b"]
    pinned = m.acquire([(b"c", 4)], chunk_keys={b"c"})  # c stays in the pool's only page
    assert m.acquire([(b"a", 4)], chunk_keys={b"a"}) is None
    assert list(host.entries) == [b"a", b"b"] and b"a" in host.busy  # held, not refreshed
    m.release(pinned.entries)
    m.take_jobs()
    got = m.acquire([(b"a", 4)], chunk_keys={b"a"})  # c → host evicts b, not a: a is read
    assert got is not None and got.entries[0].resident
    assert list(host.entries) == [b"c", b"a"]


def test_one_step_never_writes_the_same_host_rows_twice():
    # Pool of 2 pages, host of 1: a and b leave the pool in one step. b may not replace the copy of
    # a written in that step (one index_copy_ with the same rows twice has no defined winner).
    m, host = with_host(2, host_pages=1)
    resident(m, b"a")
    resident(m, b"b")
    m.take_jobs()
    resident(m, b"c")  # a → host
    resident(m, b"d")  # b cannot go to host: its only page is a's, written in this step
    jobs = take_host_jobs(m)
    assert len(jobs.write_to) == len(set(jobs.write_to)) == 4
    assert host.entries.keys() == {b"a"}
    resident(m, b"e")  # the step was sent: c replaces a's copy now
    assert host.entries.keys() == {b"c"}


def test_a_reset_does_not_hand_out_host_rows_the_step_still_reads():
    m, host = with_host(2, host_pages=1)
    resident(m, b"a")
    resident(m, b"b")
    resident(m, b"c")  # a → host
    m.take_jobs()
    got = m.acquire([(b"a", 4)], chunk_keys={b"a"})  # a read back from host in this step
    m.clear()  # a reset in the same step: a stays pinned, its host copy is still to be read
    resident(m, b"x")
    resident(m, b"y")  # x leaves the pool: a's host page is not free before the step is sent
    jobs = take_host_jobs(m)
    assert not set(jobs.write_to) & set(jobs.read_from) and len(jobs.read_from) == 4
    m.release(got.entries)  # a, dropped, frees its pool page
    resident(m, b"z")
    resident(m, b"w")  # y leaves the pool and takes the host page, free now
    assert host.entries.keys() == {b"y"}


def test_a_missing_entry_is_read_from_the_remote_store_and_counted_when_the_read_ends():
    m = make()
    m.add_tier(RemoteStoreTier(m))
    got = m.acquire([(b"s", 2), (b"a", 4)], chunk_keys={b"a"})
    assert got.created == [] and got.fetches == got.entries and all(e.fetching for e in got.entries)
    joined = m.acquire([(b"a", 4)], chunk_keys={b"a"})
    assert joined.fetches == [] and (m.stats.misses, m.stats.inflight_joins) == (1, 1)
    sys_entry, chunk = got.entries
    m.fetched(sys_entry, True)
    assert sys_entry.resident and m.stats.remote_hits == 0 and not m.refills
    m.fetched(chunk, False)
    assert m.take_refills() == [chunk] and not chunk.resident  # held: it must be computed now
    assert (m.stats.misses, m.stats.miss_tokens, m.stats.remote_read_failures) == (2, 8, 1)


def test_a_failed_read_nobody_holds_any_more_frees_its_pages():
    m = make()
    m.add_tier(RemoteStoreTier(m))
    got = m.acquire([(b"a", 4)], chunk_keys={b"a"})
    m.release(got.entries)
    m.fetched(got.entries[0], False)
    assert not m.refills and m.entries == {} and m.used_pages == 0
