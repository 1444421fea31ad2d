"""The tiers below the pool behind one interface (`tiers.base.Tier`): a third backend, the
test-only `MemoryTier`, joins the manager with no edits to it, under the host tier; a random
sequence of acquisitions, prefills, fills, evictions and resets keeps the pool's bookkeeping."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.memory_tier import MemoryTier
from tests.helpers.tier_steps import take_host_jobs
from vllm_ascend_chunk.scheduler.manager import ChunkCacheManager, Entry, EntryState
from vllm_ascend_chunk.tiers.base import Kept
from vllm_ascend_chunk.tiers.host.scheduler import HostTier

PAGE = 4
KEYS = {b"a": 4, b"b": 6, b"c": 3, b"d": 8, b"e": 4, b"f": 2, b"g": 5, b"h": 1}
"""Key → tokens: the documents the random requests ask for."""


def tiered(
    num_pages: int, host_pages: int, lru_threshold: float = 1.0
) -> tuple[ChunkCacheManager, HostTier | None, MemoryTier]:
    """A pool over a host tier (if `host_pages`) and then a memory tier."""
    m = ChunkCacheManager(num_pages, PAGE, lru_threshold)
    host = HostTier(host_pages, PAGE, m.stats) if host_pages else None
    memory = MemoryTier(m)
    for tier in (host, memory):
        if tier is not None:
            m.add_tier(tier)
    return m, host, memory


def resident(m: ChunkCacheManager, key: bytes) -> Entry:
    entry = m.acquire([(key, KEYS[key])], chunk_keys={key}).entries[0]
    m.mark_resident(entry)
    m.release([entry])
    return entry


def test_a_key_is_filled_by_the_first_tier_that_has_it_and_evictions_reach_every_tier():
    m, host, memory = tiered(num_pages=3, host_pages=1)
    resident(m, b"d")  # 2 pages
    resident(m, b"a")
    resident(m, b"e")  # d leaves the pool: too large for the host tier, kept by the memory tier
    assert b"d" not in host.index.entries and memory.copies == {b"d": 8}
    resident(m, b"c")
    resident(m, b"f")  # a leaves the pool: copied to both tiers
    assert host.index.entries.keys() == {b"a"} and memory.copies == {b"d": 8, b"a": 4}
    m.take_jobs()
    got = m.acquire([(b"a", 4)], chunk_keys={b"a"})  # the host tier comes first: copied back with the step
    assert got.entries[0].resident and got.filled == {b"a": host} and memory.filling == []
    m.release(got.entries)
    m.take_jobs()
    got = m.acquire([(b"d", 8)], chunk_keys={b"d"})  # only the memory tier has it: filled later
    (entry,) = got.entries
    assert got.fetches == [entry] and entry.state is EntryState.FETCHING and entry.source is memory
    assert memory.finish(0, ok=True) is entry and entry.resident and not m.refills
    assert (memory.hits, memory.hit_tokens, m.stats.host_hits, m.stats.remote_hits) == (1, 8, 1, 0)


def test_a_failed_fill_is_computed_while_held_and_counted_a_miss():
    m, _, memory = tiered(num_pages=4, host_pages=0)
    memory.prepare_store(Entry(key=b"b", num_tokens=6, pages=[0, 1]), Kept.EVICTED)
    got = m.acquire([(b"b", 6)], chunk_keys={b"b"})
    assert got.created == [] and memory.filling == got.entries
    misses = m.stats.misses
    assert memory.finish(0, ok=False) is got.entries[0]
    assert m.take_refills() == got.entries  # held: compute it now
    assert m.stats.misses == misses + 1 and memory.failures == 1


class TieredRun:
    """Requests pin sets of keys; prefills of the entries nobody fills end, or fail; the memory
    tier's fills end, or fail; requests leave; resets. `live` is every entry not freed yet."""

    def __init__(self, num_pages: int, host_pages: int, lru_threshold: float) -> None:
        self.m, self.host, self.memory = tiered(num_pages, host_pages, lru_threshold)
        self.requests: list[list[Entry]] = []
        self.computing: list[Entry] = []
        """Entries a prefill computes (created, or whose fill failed while held)."""
        self.live: dict[int, Entry] = {}

    def operations(self) -> list:
        """The operations possible now."""
        return [
            op
            for op, possible in (
                (self.acquire, len(self.requests) < 3),
                (self.request_ends, self.requests),
                (self.prefills_end, self.computing),
                (self.fill_ends, self.memory.filling),
                (self.reset, True),
            )
            if possible
        ]

    def acquire(self, data) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(KEYS)), min_size=1, max_size=3))
        got = self.m.acquire(
            [(k, KEYS[k]) for k in keys], chunk_keys=set(keys), count=data.draw(st.booleans())
        )
        if got is None:
            return
        assert [e.key for e in got.entries] == keys
        self.requests.append(got.entries)
        self.computing += got.created
        self.live.update({id(e): e for e in got.entries})
        jobs = take_host_jobs(self.m)  # the step is sent
        assert len(jobs.read_from) == len(jobs.read_to) and len(jobs.write_from) == len(jobs.write_to)

    def request_ends(self, data) -> None:
        self.m.release(self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1))))

    def prefills_end(self, data) -> None:
        """The prefills in flight end, most of them computed, some failed."""
        computing, self.computing = self.computing, []
        for entry in computing:
            if data.draw(st.sampled_from([True, True, True, False])):
                self.m.mark_resident(entry)
                continue
            for held in [r for r in self.requests if entry in r]:  # computed again elsewhere
                self.requests.remove(held)
                self.m.release(held)
            self.m.discard(entry)

    def fill_ends(self, data) -> None:
        index = data.draw(st.integers(0, len(self.memory.filling) - 1))
        self.memory.finish(index, ok=data.draw(st.booleans()))
        self.computing += self.m.take_refills()

    def reset(self, data) -> None:
        """As the coordinator resets: the requests still waiting for an entry are released first
        (planned again later); those holding resident entries only may be loading from them."""
        for entries in [r for r in self.requests if not all(e.resident for e in r)]:
            self.requests.remove(entries)
            self.m.release(entries)
        self.m.clear()
        self.m.take_jobs()

    def check(self) -> None:
        m = self.m
        live = [e for e in self.live.values() if e.state is not EntryState.FREED]
        taken = [p for e in live for p in e.pages]
        assert sorted(taken + m.free_pages) == list(range(m.num_pages)), "pages lost or shared"
        assert all(m.entries.get(e.key) is e for e in live if not e.dropped)
        pins: dict[int, int] = {}
        for entries in self.requests:
            for entry in {id(e): e for e in entries}.values():
                pins[id(entry)] = pins.get(id(entry), 0) + 1
        assert all(e.pins == pins.get(id(e), 0) for e in live)
        for entry in live:
            if not entry.resident:
                assert (entry in self.memory.filling) == entry.fetching
                assert entry.fetching or entry in self.computing, f"orphan {entry.state.value} entry"
        if self.host is not None:
            index = self.host.index
            held = [*index.entries.values(), *index.retired]
            assert sorted([p for e in held for p in e.pages] + index.free_pages) == list(
                range(index.num_pages)
            )

    def drain(self) -> None:
        """Every fill and prefill ends, every request leaves: nothing pinned or pending."""
        while self.memory.filling or self.computing:
            if self.memory.filling:
                self.memory.finish(0, ok=True)
                assert not self.m.refills
            else:
                self.m.mark_resident(self.computing.pop())
        for entries in self.requests:
            self.m.release(entries)
        assert self.m.pinned_entries == 0 and all(e.resident for e in self.m.entries.values())
        assert self.m.used_pages == sum(len(e.pages) for e in self.m.entries.values())


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_pages=st.integers(min_value=3, max_value=8),
    host_pages=st.sampled_from([0, 2, 5]),
    lru_threshold=st.sampled_from([0.3, 0.6, 1.0]),  # low: evictions as soon as pins go
)
def test_tiered_manager_random_operations(data, num_pages: int, host_pages: int, lru_threshold: float):
    run = TieredRun(num_pages, host_pages, lru_threshold)
    for _ in range(60):
        data.draw(st.sampled_from(run.operations()))(data)
        run.check()
    run.drain()
