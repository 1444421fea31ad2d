"""HostIndex without an engine: pages of the host-memory tier, LRU eviction, the copies busy in
the step being built (never evicted nor overwritten in it), and resets that retire busy pages
until the step is sent."""

from __future__ import annotations

import random

import pytest

from vllm_ascend_chunk.tiers.host.index import HostEntry, HostIndex

PAGE = 4


def make(num_pages: int = 4) -> HostIndex:
    return HostIndex(num_pages, PAGE)


def check_pages(index: HostIndex) -> None:
    """Free pages, live copies' pages and retired pages partition the tier, each page once."""
    held = [p for e in [*index.entries.values(), *index.retired] for p in e.pages]
    assert sorted(held + index.free_pages) == list(range(index.num_pages))


def filled(keys: bytes = b"abc", num_pages: int = 4) -> HostIndex:
    """A tier holding one-page copies of `keys` (stored in that order), step sent."""
    index = make(num_pages)
    for key in keys:
        assert index.store(bytes([key]), PAGE) is not None
    index.end_step()
    return index


def test_a_copy_gets_whole_pages_and_one_row_per_token_in_order() -> None:
    index = make()
    entry = index.store(b"a", 6)
    assert entry is not None and (entry.key, entry.num_tokens) == (b"a", 6)
    assert len(entry.pages) == 2 and len(index.free_pages) == 2
    rows = entry.rows(PAGE)
    assert len(rows) == 6 and len(set(rows)) == 6
    assert rows == [entry.pages[t // PAGE] * PAGE + t % PAGE for t in range(6)]
    assert index.usage_ratio == 0.5
    assert index.hold(b"a") is entry
    check_pages(index)


def test_copies_never_share_a_page() -> None:
    index = make(7)
    entries = [index.store(bytes([k]), n) for k, n in zip(b"abcd", [1, 4, 5, 9], strict=True)]
    rows = [r for e in entries for r in e.rows(PAGE)]
    assert len(rows) == len(set(rows)) == 19
    assert index.usage_ratio == 1.0 and not index.free_pages
    check_pages(index)


def test_absent_keys() -> None:
    index = filled(b"a")
    assert index.hold(b"x") is None and not index.touch(b"x")
    assert b"x" not in index.busy  # a miss does not hold anything for the step
    assert index.touch(b"a") and b"a" not in index.busy  # touch refreshes, does not hold


def test_a_full_tier_evicts_the_least_recently_used_copy() -> None:
    index = filled(b"abcd")
    pages_a = index.entries[b"a"].pages
    entry = index.store(b"e", PAGE)
    assert entry is not None and entry.pages == pages_a
    assert list(index.entries) == [b"b", b"c", b"d", b"e"] and index.evictions == 1
    check_pages(index)


@pytest.mark.parametrize("refresh, evicted", [("touch", b"b"), ("hold", b"a")])
def test_touch_makes_a_copy_most_recently_used_and_hold_leaves_its_place(
    refresh: str, evicted: bytes
) -> None:
    index = filled(b"abcd")
    getattr(index, refresh)(b"a")
    index.end_step()
    assert index.store(b"e", PAGE) is not None
    assert evicted not in index.entries and len(index.entries) == 4


def test_eviction_takes_as_many_copies_as_needed_and_no_more() -> None:
    index = filled(b"abcd", num_pages=5)
    assert index.store(b"e", 2 * PAGE + 1) is not None  # three pages, one free: a and b go
    assert list(index.entries) == [b"c", b"d", b"e"] and index.evictions == 2
    assert not index.free_pages
    index.end_step()
    index.clear()
    assert index.store(b"f", 1) is not None and index.evictions == 2  # room: nothing evicted
    check_pages(index)


def test_copies_held_this_step_are_not_evicted_in_it() -> None:
    index = filled(b"abcd")
    assert index.hold(b"a") is not None  # a stays least recently used, but busy
    assert index.store(b"e", PAGE) is not None
    assert b"a" in index.entries and b"b" not in index.entries
    index.end_step()
    assert index.store(b"f", PAGE) is not None  # sent: a may go now
    assert b"a" not in index.entries


def test_copies_stored_this_step_are_not_overwritten_in_it() -> None:
    """One step never writes the same host rows twice."""
    index = make(2)
    first = index.store(b"a", PAGE)
    second = index.store(b"b", PAGE)
    assert index.store(b"c", PAGE) is None
    assert set(index.entries) == {b"a", b"b"} and index.evictions == 0
    index.end_step()
    third = index.store(b"c", PAGE)
    assert third is not None and third.pages == first.pages and second.pages != first.pages


def test_a_store_that_cannot_be_placed_changes_nothing() -> None:
    index = filled(b"abcd")
    index.hold(b"a")
    index.hold(b"b")
    before = (list(index.entries), list(index.free_pages), index.evictions)
    assert index.store(b"e", 3 * PAGE) is None  # c and d free only two pages: neither evicted
    assert (list(index.entries), list(index.free_pages), index.evictions) == before
    assert b"e" not in index.busy
    check_pages(index)


def test_a_copy_larger_than_the_tier_is_refused() -> None:
    index = make(2)
    assert index.store(b"big", 2 * PAGE + 1) is None
    assert not index.entries and len(index.free_pages) == 2


def test_a_tier_without_pages() -> None:
    index = make(0)
    assert index.usage_ratio == 0.0
    assert index.store(b"a", 1) is None and index.hold(b"a") is None


def test_clear_frees_idle_copies_at_once() -> None:
    index = filled(b"abc")
    index.clear()
    assert not index.entries and not index.retired and len(index.free_pages) == 4
    assert index.hold(b"a") is None
    assert index.evictions == 0  # a reset is not an eviction


def test_clear_keeps_busy_pages_taken_until_the_step_is_sent() -> None:
    index = filled(b"abc")
    held = index.hold(b"a")
    stored = index.store(b"d", PAGE)
    index.clear()
    # Gone for lookups at once...
    assert not index.entries and index.hold(b"a") is None and not index.touch(b"d")
    # ...but the step's copies still read and write their pages: no new copy gets them.
    busy_pages = set(held.pages) | set(stored.pages)
    assert {p for e in index.retired for p in e.pages} == busy_pages
    check_pages(index)
    again = index.store(b"a", 2 * PAGE)
    assert again is not None and not set(again.pages) & busy_pages
    assert index.store(b"e", PAGE) is None  # only retired pages are left
    index.end_step()
    assert not index.retired and len(index.free_pages) == 2
    check_pages(index)
    assert index.store(b"e", 2 * PAGE) is not None


def test_repeated_clears_and_step_ends_free_each_page_once() -> None:
    index = filled(b"ab")
    index.hold(b"a")
    index.clear()
    index.clear()
    index.end_step()
    index.end_step()
    index.clear()
    assert sorted(index.free_pages) == [0, 1, 2, 3] and not index.retired
    check_pages(index)


def test_rows_of_an_entry_built_by_hand() -> None:
    entry = HostEntry(key=b"k", num_tokens=5, pages=[3, 0])
    assert entry.rows(4) == [12, 13, 14, 15, 0]
    assert HostEntry(key=b"k", num_tokens=0, pages=[]).rows(4) == []


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_against_a_reference_model(seed: int) -> None:
    """Any sequence of holds, touches, stores, resets and step ends: pages partition the tier;
    each store evicts exactly the least recently used idle copies it needs, or refuses and
    changes nothing; no page is handed out twice in one step while a copy reads or writes it."""
    rng = random.Random(seed)
    num_pages = rng.randint(1, 8)
    index = HostIndex(num_pages, PAGE)
    order: list[bytes] = []  # the model: least recently used first
    busy: set[bytes] = set()
    step_pages: set[int] = set()  # pages read or written in the step being built
    keys = [b"k%d" % i for i in range(10)]
    for _ in range(300):
        op = rng.choice(["hold", "touch", "store", "store", "end_step", "clear"])
        key = rng.choice(keys)
        if op == "hold":
            entry = index.hold(key)
            assert (entry is not None) == (key in order)
            if entry is not None:
                busy.add(key)
                step_pages |= set(entry.pages)
        elif op == "touch":
            assert index.touch(key) == (key in order)
            if key in order:
                order.remove(key)
                order.append(key)
        elif op == "store" and key not in order:
            num_tokens = rng.randint(1, 3 * PAGE)
            needed = -(-num_tokens // PAGE)
            shortfall = needed - len(index.free_pages)
            victims, freed = [], 0
            for k in order:
                if freed >= shortfall:
                    break
                if k not in busy:
                    victims.append(k)
                    freed += len(index.entries[k].pages)
            evictions = index.evictions
            entry = index.store(key, num_tokens)
            if freed < shortfall:
                assert entry is None and list(index.entries) == order and index.evictions == evictions
            else:
                assert entry is not None and len(entry.pages) == needed
                assert not set(entry.pages) & step_pages, "a page busy in this step was handed out"
                for k in victims:
                    order.remove(k)
                order.append(key)
                busy.add(key)
                step_pages |= set(entry.pages)
                assert index.evictions == evictions + len(victims)
        elif op == "end_step":
            index.end_step()
            busy.clear()
            step_pages.clear()
        elif op == "clear":
            index.clear()
            order.clear()
        assert list(index.entries) == order
        assert index.busy >= {k for k in busy if k in order}
        check_pages(index)
