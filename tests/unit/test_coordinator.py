"""ChunkCacheCoordinator without an engine, driven the way vLLM's scheduler drives it.

Requests are stand-ins with the fields the coordinator reads. The stateful test runs thousands
of random operation sequences (new requests, schedule steps with partial admission and prefix
hits, chunk prefills that end, end early or are preempted after their last forward, aborts,
preemptions, resets), with or without a host tier and a remote store (whose reads succeed or
fail at random), and after every operation checks the bookkeeping invariants and, through a
simulated pool, host tier and store whose rows remember which chunk wrote them, that every
load reads exactly the chunk it expects, never a row another prefill is writing and never a
row from before a reset, and that every remote write holds exactly its entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.helpers.coordinator_checks import check_bookkeeping, check_drained
from tests.helpers.memory_tier import MemoryTier
from tests.helpers.tier_steps import host_jobs, remote_jobs, remote_report, remote_tier, with_remote
from vllm_ascend_chunk.config.settings import get_config
from vllm_ascend_chunk.core.geometry import PoolGeometry
from vllm_ascend_chunk.core.paging import pages_for, slot_of
from vllm_ascend_chunk.core.request_info import ChunkCacheInfo
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata
from vllm_ascend_chunk.scheduler.coordinator import ChunkCacheCoordinator
from vllm_ascend_chunk.scheduler.prefills import ChunkPrefill
from vllm_ascend_chunk.scheduler.requests import ChunkPathStatus
from vllm_ascend_chunk.tiers.mooncake.jobs import RemoteRead

BLOCK = 4
"""Paged-KV block size of the fake engine."""
PAGE = 4
"""Pool page size (tokens)."""
DOCS = {b"d%d" % i: n for i, n in enumerate([3, 4, 5, 8, 2, 9, 4])}
"""The corpus: document key → token count."""


def undefined_where_duplicate(rows: list[int], values: list) -> dict:
    """Row -> value of one row copy, None where the copy writes a row more than once."""
    out = dict(zip(rows, values, strict=True))
    return {r: None if rows.count(r) > 1 else v for r, v in out.items()}


@dataclass
class FakeRequest:
    """The fields of `vllm.v1.request.Request` the coordinator reads."""

    request_id: str
    prompt_token_ids: list[int]
    chunk_cache: ChunkCacheInfo | None = None
    priority: int = 0
    arrival_time: float = 0.0
    num_output_tokens: int = 0
    num_computed_tokens: int = 0
    status: str = "WAITING"
    cache_salt: str | None = None


@dataclass
class FakeBlocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class FakeNewRequest:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0


@dataclass
class FakeCachedRequests:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class FakeOutput:
    """The fields of `SchedulerOutput` the coordinator reads."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_new_reqs: list[FakeNewRequest] = field(default_factory=list)
    scheduled_cached_reqs: FakeCachedRequests = field(default_factory=FakeCachedRequests)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


def user_request(
    rid: str,
    docs: list[bytes],
    sys_len: int = 2,
    question_len: int = 2,
    priority: int = 0,
    arrival: float = 0.0,
    salt: bytes = b"",
) -> FakeRequest:
    lens = [DOCS[d] for d in docs]
    sys_key = b"s%d" % sys_len + salt  # keys as the frontend makes them: chunk keys include SYS
    info = ChunkCacheInfo(
        sys_len=sys_len,
        chunk_lens=lens,
        question_len=question_len,
        sys_hash=sys_key,
        chunk_hashes=[sys_key + b"/" + d for d in docs],
    )
    ids = list(range(info.num_tokens))
    return FakeRequest(rid, ids, info, priority=priority, arrival_time=arrival)


def coordinator(
    num_pages: int, priority: bool = False, host_pages: int = 0, has_remote: bool = False, ranks: int = 1
) -> ChunkCacheCoordinator:
    geometry = PoolGeometry(
        num_layers=1,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        num_pages=num_pages,
        page_size=PAGE,
        num_host_pages=host_pages,
    )
    return ChunkCacheCoordinator(
        geometry,
        BLOCK,
        with_remote(get_config()) if has_remote else get_config(),
        priority_order=priority,
        ranks=ranks,
    )


def prefill_request(prefill: ChunkPrefill) -> FakeRequest:
    return FakeRequest(prefill.request_id, prefill.token_ids)


_BLOCK_BASES: dict[str, int] = {}


def blocks_for(request: FakeRequest) -> FakeBlocks:
    """The blocks of a request: its own range, the same at every call."""
    n = pages_for(len(request.prompt_token_ids), BLOCK)
    base = _BLOCK_BASES.setdefault(request.request_id, len(_BLOCK_BASES)) * 100
    return FakeBlocks(list(range(base, base + n)))


def prefill_step(prefills: list[ChunkPrefill], others: dict[str, int] | None = None) -> FakeOutput:
    """A step that computes these new prefills' whole prompts (and one token of `others`)."""
    new = [FakeNewRequest(p.request_id, blocks_for(prefill_request(p)).get_block_ids()) for p in prefills]
    return FakeOutput({p.request_id: len(p.token_ids) for p in prefills} | (others or {}), new)


def run_prefills(coord: ChunkCacheCoordinator, prefills: list[ChunkPrefill]) -> None:
    """Schedule the prefills for one step, then finish them with their sampled token."""
    coord.build_connector_meta(prefill_step(prefills))
    for prefill in prefills:
        coord.request_finished(
            FakeRequest(
                prefill.request_id,
                prefill.token_ids,
                num_output_tokens=1,
                num_computed_tokens=len(prefill.token_ids),
            )
        )


def admit(coord: ChunkCacheCoordinator, request: FakeRequest, local_hit: int = 0):
    n, _ = coord.get_num_new_matched_tokens(request, local_hit)
    assert n is not None
    coord.update_state_after_alloc(request, blocks_for(request), n)
    return coord.build_connector_meta(FakeOutput({request.request_id: 1}))


# -- single scenarios ----------------------------------------------------------------------------
def test_query_changes_nothing():
    coord = coordinator(16)
    req = user_request("r", [b"d0", b"d1"])
    coord.on_new_request(req)
    prefills = coord.plan()
    assert coord.get_num_new_matched_tokens(req, 0) == (None, False)
    assert coord.get_num_new_matched_tokens(req, req.chunk_cache.question_start) == (0, False)
    assert coord.users["r"].status is ChunkPathStatus.PLANNED
    assert all(e.pins == 1 for e in coord.users["r"].entries)
    run_prefills(coord, prefills)
    for _ in range(2):
        assert coord.get_num_new_matched_tokens(req, 4) == (req.chunk_cache.question_start - 4, False)
    assert coord.users["r"].status is ChunkPathStatus.PLANNED and coord.manager.pinned_entries == 3


def test_load_then_preemption_plans_again_without_counting_twice():
    coord = coordinator(16)
    req = user_request("r", [b"d0", b"d1"])
    coord.on_new_request(req)
    run_prefills(coord, coord.plan())
    meta = admit(coord, req)
    assert len(meta.load_rows) == req.chunk_cache.question_start
    assert coord.users["r"].status is ChunkPathStatus.LOADED and coord.manager.pinned_entries == 0
    coord.on_preempted(req)
    assert coord.users["r"].status is ChunkPathStatus.WAITING
    assert coord.plan() == [] and coord.users["r"].ready
    assert (coord.manager.stats.hits, coord.manager.stats.misses) == (0, 2)


def test_a_tier_the_coordinator_never_names_fills_what_it_has_and_what_it_fails_is_computed():
    """A third backend (the test-only `MemoryTier`) joins under the pool with no edit to the
    coordinator: its fills keep the request waiting, a failed one becomes a chunk prefill."""
    coord = coordinator(16)
    memory = MemoryTier(coord.manager)
    coord.manager.add_tier(memory)
    req = user_request("r", [b"d0", b"d1"])
    info = req.chunk_cache
    memory.copies = {info.sys_hash: info.sys_len, info.chunk_hashes[0]: info.chunk_lens[0]}
    coord.on_new_request(req)
    (prefill,) = coord.plan()  # d1 alone is computed; SYS and d0 are filled by the memory tier
    sys_entry, d0, d1 = coord.users["r"].entries
    assert prefill.entries == [d1] and memory.filling == [sys_entry, d0]
    run_prefills(coord, [prefill])
    assert coord.get_num_new_matched_tokens(req, 0) == (None, False)  # still filling
    memory.finish(0, ok=True)
    memory.finish(0, ok=False)  # d0 failed while r holds it
    (refill,) = coord.plan()
    assert refill.entries == [d0] and not coord.manager.refills
    run_prefills(coord, [refill])
    meta = admit(coord, req)
    assert len(meta.load_rows) == info.question_start and coord.users["r"].status is ChunkPathStatus.LOADED
    assert (memory.hits, memory.hit_tokens, memory.failures) == (0, 0, 1)  # SYS is no chunk
    check_drained(coord)


def test_reads_from_the_remote_store_that_arrive_load_and_those_that_fail_are_computed():
    """Step by step (the stateful test below draws such steps at random): every missing entry is
    read, no chunk prefill runs while the reads are out, and a failed read becomes one."""
    coord = coordinator(64, has_remote=True)
    arrive = user_request("r", [b"d0", b"d1"])
    coord.on_new_request(arrive)
    assert coord.plan() == []  # SYS, d0 and d1 are read, none computed
    meta = coord.build_connector_meta(FakeOutput({}))
    assert [read.key for read in remote_jobs(meta).reads] == [e.key for e in coord.users["r"].entries]
    coord.update_connector_output(remote_report({0: {r.read_id: True for r in remote_jobs(meta).reads}}))
    assert coord.plan() == [] and coord.users["r"].ready
    assert len(admit(coord, arrive).load_rows) == arrive.chunk_cache.question_start

    fail = user_request("q", [b"d2", b"d3"])
    coord.on_new_request(fail)
    assert coord.plan() == []  # SYS is resident: d2 and d3 are read
    meta = coord.build_connector_meta(FakeOutput({}))
    assert len(remote_jobs(meta).reads) == 2
    coord.update_connector_output(remote_report({0: {r.read_id: False for r in remote_jobs(meta).reads}}))
    prefills = coord.plan()
    assert [p.entries for p in prefills] == [[e] for e in coord.users["q"].entries[1:]]
    run_prefills(coord, prefills)
    assert coord.plan() == [] and len(admit(coord, fail).load_rows) == fail.chunk_cache.question_start
    stats = coord.manager.stats
    assert (stats.remote_reads, stats.remote_read_failures, stats.remote_hits) == (5, 2, 2)
    check_drained(coord)


def test_a_request_loaded_elsewhere_is_never_planned_but_keeps_its_layout(chunk_env):
    """P/D decode instance: another connector loads the whole chunk region; the chunk cache plans
    nothing, loads nothing, and still places the tokens computed after it."""
    chunk_env(VLLM_CHUNK_CACHE_LAYOUT="overlap")
    coord = coordinator(16)
    req = user_request("r", [b"d0", b"d1"])
    coord.on_new_request(req)
    coord.load_elsewhere(req, req.chunk_cache.question_start + 1)
    assert coord.is_external(req) and coord.plan() == [] and coord.manager.pinned_entries == 0
    assert coord.get_num_new_matched_tokens(req, 0) == (0, False)
    coord.update_state_after_alloc(req, blocks_for(req), 0)
    assert coord.manager.stats.external_loads == 0  # counted once admitted with its load
    coord.admitted_elsewhere(req.chunk_cache.question_start + 1)
    req.num_computed_tokens = req.chunk_cache.question_start + 1  # what the other connector loaded
    meta = coord.build_connector_meta(FakeOutput({"r": 2}))
    shift = coord.layout.shift_at(req.chunk_cache, req.chunk_cache.question_start)
    assert meta.load_rows == [] and meta.position_shifts == {"r": shift} and shift != 0
    stats = coord.manager.stats
    assert (stats.external_loads, stats.external_load_tokens) == (1, req.chunk_cache.question_start + 1)
    assert (stats.hits, stats.misses, stats.chunk_prefills) == (0, 0, 0)


@pytest.mark.parametrize("how", ["preempted", "no longer covered"])
def test_a_request_loaded_elsewhere_falls_back_to_the_chunk_cache(how):
    coord = coordinator(16)
    req = user_request("r", [b"d0", b"d1"])
    coord.on_new_request(req)
    coord.load_elsewhere(req, req.chunk_cache.question_start)
    if how == "preempted":
        coord.on_preempted(req)
    else:
        coord.serve_here(req)
    assert not coord.is_external(req) and coord.users["r"].status is ChunkPathStatus.WAITING
    run_prefills(coord, coord.plan())
    meta = admit(coord, req)
    assert len(meta.load_rows) == req.chunk_cache.question_start
    check_drained(coord)


def test_saves_follow_each_piece_of_a_chunk_prefill_and_its_blocks_after_preemption():
    """Chunked prefill: each step saves the tokens it computes, from the slots of the blocks the
    scheduler outputs announced (appended while running, replaced when resumed)."""
    coord = coordinator(16)
    req = user_request("r", [b"d3"], sys_len=2)  # the prefill: SYS (2) + d3 (8) = 10 tokens
    coord.on_new_request(req)
    (prefill,) = coord.plan()
    rid, rows = prefill.request_id, prefill.pool_rows
    meta = coord.build_connector_meta(FakeOutput({rid: 6}, [FakeNewRequest(rid, ([7, 3],))]))
    assert (meta.save_rows, meta.save_slots) == (rows[:6], [28, 29, 30, 31, 12, 13])
    cached = FakeCachedRequests([rid], set(), [([5],)], [6])
    meta = coord.build_connector_meta(FakeOutput({rid: 3}, scheduled_cached_reqs=cached))
    assert (meta.save_rows, meta.save_slots) == (rows[6:9], [14, 15, 20])
    resumed = FakeCachedRequests([rid], {rid}, [([1, 2, 9],)], [0])  # preempted, then resumed
    meta = coord.build_connector_meta(FakeOutput({rid: 10}, scheduled_cached_reqs=resumed))
    assert (meta.save_rows, meta.save_slots) == (rows, [4, 5, 6, 7, 8, 9, 10, 11, 36, 37])


def test_prefix_cache_hit_of_the_whole_region_loads_nothing():
    coord = coordinator(16)
    req = user_request("r", [b"d0"])
    coord.on_new_request(req)
    coord.plan()  # the chunk prefill is still running
    meta = admit(coord, req, local_hit=req.chunk_cache.question_start)
    assert meta.load_rows == [] and coord.users["r"].status is ChunkPathStatus.LOADED
    assert coord.manager.pinned_entries == 0


def test_chunk_prefill_preempted_after_its_last_forward_still_fills_the_pool():
    """Async scheduling: the prefill's last piece ran, the prefill was preempted (num_computed_tokens
    back to 0), then its sampled token arrived and finished it."""
    coord = coordinator(16)
    req = user_request("r", [b"d0"])
    coord.on_new_request(req)
    (prefill,) = coord.plan()
    coord.build_connector_meta(prefill_step([prefill]))
    coord.request_finished(
        FakeRequest(
            prefill.request_id,
            prefill.token_ids,
            num_output_tokens=1,
            num_computed_tokens=0,
            status="FINISHED_LENGTH_CAPPED",
        )
    )
    assert all(e.resident for e in prefill.entries)
    assert coord.users["r"].ready


def test_chunk_prefill_ended_without_output_is_planned_again():
    coord = coordinator(16)
    req = user_request("r", [b"d0"])
    coord.on_new_request(req)
    (prefill,) = coord.plan()
    coord.request_finished(FakeRequest(prefill.request_id, prefill.token_ids, status="FINISHED_ABORTED"))
    assert coord.users["r"].status is ChunkPathStatus.WAITING and coord.manager.entries == {}
    (again,) = coord.plan()
    assert again.token_ids == prefill.token_ids


def test_reset_with_a_prefill_in_flight_never_hands_its_pages_out():
    coord = coordinator(4)  # 16 rows
    first = user_request("a", [b"d5"])  # SYS 2 + 9 tokens: 1 + 3 pages
    coord.on_new_request(first)
    (prefill,) = coord.plan()
    coord.request_finished(first)  # the client went away; its chunk prefill goes on
    coord.reset()
    second = user_request("b", [b"d3"], salt=b"x")  # 1 + 2 pages: does not fit beside the orphan
    coord.on_new_request(second)
    assert coord.plan() == []
    run_prefills(coord, [prefill])  # the orphan ends: its pages come back, its entries stay dropped
    assert len(coord.plan()) == 1
    assert coord.manager.entries.keys() == {b"s2x", b"s2x/d3"}


def test_reset_unplans_requests_pinned_on_resident_entries():
    coord = coordinator(16)
    warm = user_request("w", [b"d0"])
    coord.on_new_request(warm)
    run_prefills(coord, coord.plan())
    waiting = user_request("r", [b"d0"])
    coord.on_new_request(waiting)
    assert coord.plan() == [] and coord.users["r"].ready
    coord.reset()
    assert coord.users["r"].status is ChunkPathStatus.WAITING and coord.manager.used_pages == 0
    assert len(coord.plan()) == 1  # computed again: nothing from before the reset is loaded


def test_blocked_request_does_not_block_a_fully_cached_one_behind_it():
    coord = coordinator(6)  # 24 rows
    warm = user_request("w", [b"d0"])  # SYS + d0: 2 pages
    coord.on_new_request(warm)
    run_prefills(coord, coord.plan())
    holder = user_request("h", [b"d3"])  # 2 pages, its prefill in flight
    coord.on_new_request(holder)
    coord.plan()
    big = user_request("big", [b"d5", b"d6"])  # needs 3 + 1 new pages, only 2 free
    cached = user_request("c", [b"d0"])
    for req in (big, cached):
        coord.on_new_request(req)
    assert coord.plan() == []
    assert coord.users["big"].status is ChunkPathStatus.WAITING and coord.users["c"].ready
    late = user_request("late", [b"d4"])  # needs a new page: waits behind the blocked head
    coord.on_new_request(late)
    coord.plan()
    assert coord.users["late"].status is ChunkPathStatus.WAITING


def test_blocked_head_is_not_starved_by_pins_behind_it():
    coord = coordinator(5)  # 20 rows
    coord.on_new_request(warm := user_request("w", [b"d0", b"d1"]))  # SYS + d0 + d1: 3 pages
    run_prefills(coord, coord.plan())
    admit(coord, warm)
    coord.on_new_request(user_request("holder", [b"d4"]))  # 1 page, in flight: 1 page left
    holder_prefills = coord.plan()
    ahead = user_request("ahead", [b"d0", b"d1"])  # pins d0 and d1
    head = user_request("head", [b"d3"])  # needs 2 pages: d0 or d1 must go, both pinned
    behind = user_request("behind", [b"d0", b"d1"])  # fully cached
    for req in (ahead, head, behind):
        coord.on_new_request(req)
    coord.plan()
    assert coord.users["head"].status is ChunkPathStatus.WAITING and coord.users["behind"].ready
    admit(coord, ahead)  # `behind` is not admitted this step (say, no token budget left)
    # At the next plan the pins of `behind` go first: the head evicts what it needs, and
    # `behind` waits for its documents again, behind the head.
    prefills = coord.plan()
    assert coord.users["head"].status is ChunkPathStatus.PLANNED and len(prefills) == 1
    assert coord.users["behind"].status is ChunkPathStatus.WAITING
    run_prefills(coord, holder_prefills + prefills)


def test_priority_order_plans_the_higher_priority_request_first():
    coord = coordinator(4, priority=True)
    low = user_request("low", [b"d3"], arrival=1.0, priority=5)  # 1 + 2 pages
    high = user_request("high", [b"d3"], arrival=2.0, priority=0, salt=b"x")  # 1 + 2 pages
    for req in (low, high):
        coord.on_new_request(req)
    prefills = coord.plan()
    assert coord.users["high"].status is ChunkPathStatus.PLANNED
    assert coord.users["low"].status is ChunkPathStatus.WAITING and len(prefills) == 1


def test_a_read_ends_when_every_rank_has_reported_it_in_whatever_step():
    """Ranks end a read in different steps: the entry waits for the last, and is resident only
    if every rank's shard arrived."""
    coord = coordinator(64, has_remote=True, ranks=2)
    good, bad = user_request("r", [b"d0"], sys_len=0), user_request("q", [b"d1"], sys_len=0)
    for request in (good, bad):
        coord.on_new_request(request)
    assert coord.plan() == []
    meta = coord.build_connector_meta(FakeOutput({}))
    assert meta.idle, "a step in which no request computes"
    (read_good, read_bad) = remote_jobs(meta).reads
    coord.update_connector_output(remote_report(reads={1: {read_good.read_id: True}}))
    coord.update_connector_output(remote_report(reads={0: {read_bad.read_id: True}}))
    assert coord.plan() == [] and not coord.users["r"].ready and not coord.users["q"].ready
    coord.update_connector_output(
        remote_report(reads={0: {read_good.read_id: True}, 1: {read_bad.read_id: False}})
    )
    assert coord.users["r"].ready
    prefills = coord.plan()  # rank 1's shard of d1 is missing: d1 is computed
    assert [p.entries for p in prefills] == [coord.users["q"].entries]
    stats = coord.manager.stats
    assert (stats.remote_reads, stats.remote_hits, stats.remote_read_failures) == (2, 1, 1)
    assert not coord.build_connector_meta(FakeOutput({"r": 1})).idle


# -- random operation sequences ------------------------------------------------------------------
class CoordinatorMachine(RuleBasedStateMachine):
    """vLLM's scheduler in miniature around a real coordinator, with a pool that remembers which
    (chunk key, token, reset generation) wrote each row."""

    def __init__(self) -> None:
        super().__init__()
        self.coord: ChunkCacheCoordinator
        self.waiting: dict[str, FakeRequest] = {}
        self.running: dict[str, FakeRequest] = {}
        self.prefills_todo: dict[str, ChunkPrefill] = {}
        self.prefills_ran: dict[str, ChunkPrefill] = {}
        self.generation = 0
        self.prefill_generation: dict[str, int] = {}
        self.rows: dict[int, tuple[bytes, int, int]] = {}
        self.host_rows: dict[int, tuple[bytes, int, int]] = {}
        self.store: dict[bytes, int] = {}
        """The remote store: key → generation of the K/V written under it."""
        self.pending_reads: list[tuple[RemoteRead, set[int]]] = []
        """Remote reads started and the worker ranks that have not ended them yet."""
        self.ranks = 1
        self.n = 0

    @initialize(
        num_pages=st.integers(min_value=8, max_value=20),
        priority=st.booleans(),
        host_pages=st.sampled_from([0, 0, 3, 6, 12]),
        has_remote=st.booleans(),
        ranks=st.sampled_from([1, 2]),
    )
    def start(self, num_pages: int, priority: bool, host_pages: int, has_remote: bool, ranks: int) -> None:
        self.coord = coordinator(num_pages, priority, host_pages, has_remote, ranks)
        self.ranks = ranks

    @rule(
        docs=st.lists(st.sampled_from(sorted(DOCS)), min_size=1, max_size=4),
        sys_len=st.integers(min_value=0, max_value=5),
        salt=st.sampled_from([b"", b"t"]),
        priority=st.integers(min_value=0, max_value=2),
    )
    @precondition(lambda self: len(self.waiting) + len(self.running) < 8)
    def new_request(self, docs: list[bytes], sys_len: int, salt: bytes, priority: int) -> None:
        self.n += 1
        req = user_request(
            f"u{self.n}", docs, sys_len=sys_len, salt=salt, priority=priority, arrival=float(self.n)
        )
        pages = sum(
            pages_for(n, PAGE)
            for n in {**dict.fromkeys([b"s"], sys_len), **{d: DOCS[d] for d in docs}}.values()
        )
        if pages > self.coord.manager.num_pages:  # the frontend refuses it (`check_fits`)
            return
        self.waiting[req.request_id] = req
        self.coord.on_new_request(req)

    @rule(data=st.data())
    def step(self, data) -> None:
        """One `schedule()` and its forward; most chunk prefills that ran get their token at the
        end of it, others stay in flight (async scheduling) until `prefill_ends`."""
        coord = self.coord
        for prefill in coord.plan():
            self.prefills_todo[prefill.request_id] = prefill
            self.prefill_generation[prefill.request_id] = self.generation
        admitted = []
        for rid, req in list(self.waiting.items()):
            start = req.chunk_cache.question_start
            local = data.draw(st.sampled_from([0, 0, 0, start, start // BLOCK * BLOCK]))
            n, _ = coord.get_num_new_matched_tokens(req, local)
            if n is None or not data.draw(st.sampled_from([True, True, True, False])):
                continue
            coord.update_state_after_alloc(req, blocks_for(req), n)
            admitted.append((req, local))
            self.running[rid] = self.waiting.pop(rid)
        ran = [p for p in self.prefills_todo.values() if data.draw(st.booleans())]
        meta = coord.build_connector_meta(prefill_step(ran, {rid: 1 for rid in self.running}))
        self._move(meta)
        self._check_loads(meta, admitted)
        self._save(meta, ran)
        self._write_remote(meta)
        self._read_remote(
            meta,
            arrives=lambda: data.draw(st.sampled_from([True, True, False])),
            up=data.draw(st.sampled_from([True, True, True, False])) if remote_tier(coord) else None,
            ends=lambda: data.draw(st.sampled_from([True, True, False])),
        )
        for prefill in ran:
            self.prefills_todo.pop(prefill.request_id)
            if data.draw(st.sampled_from([True, True, True, False])):
                coord.request_finished(
                    FakeRequest(prefill.request_id, prefill.token_ids, num_output_tokens=1)
                )
            else:
                self.prefills_ran[prefill.request_id] = prefill

    def _save(self, meta, ran: list[ChunkPrefill]) -> None:
        """After the forward: each saved slot's token (the prefill's K/V there) into its pool row."""
        assert not set(meta.save_rows) & set(meta.load_rows), "a chunk prefill writes rows loaded in its step"
        assert sorted(meta.save_rows) == sorted(r for p in ran for r in p.pool_rows if r >= 0)
        computed = {
            slot_of(blocks_for(prefill_request(prefill)).ids, BLOCK, t): (prefill, t)
            for prefill in ran
            for t in range(len(prefill.token_ids))
        }
        for row, slot in zip(meta.save_rows, meta.save_slots, strict=True):
            prefill, t = computed[slot]
            key, index = self._prefill_tokens(prefill)[t]
            assert key, f"{prefill.request_id} token {t} saved, but it belongs to no entry it fills"
            self.rows[row] = (key, index, self.prefill_generation[prefill.request_id])

    def _move(self, meta: ChunkCacheStepMetadata) -> None:
        """The host-tier copies at the start of the step: into host memory first, then out of it.
        A row written twice by one copy holds neither value for sure (`index_copy_` with duplicate
        indices has no defined winner): it holds None, which no check accepts."""
        jobs = host_jobs(meta)
        writes = [self.rows.get(r) for r in jobs.write_from]
        self.host_rows.update(undefined_where_duplicate(jobs.write_to, writes))
        reads = [self.host_rows.get(r) for r in jobs.read_from]
        self.rows.update(undefined_where_duplicate(jobs.read_to, reads))

    def _write_remote(self, meta: ChunkCacheStepMetadata) -> None:
        """Every remote write holds exactly its entry's tokens, all of one generation."""
        for write in remote_jobs(meta).writes:
            held = [self.rows.get(r) for r in write.rows]
            generation = held[0][2] if held[0] else -1
            assert held == [(write.key, t, generation) for t in range(len(held))], "wrong K/V written"
            self.store[write.key] = generation

    def _read_remote(self, meta: ChunkCacheStepMetadata, arrives, up: bool | None, ends=lambda: True) -> None:
        """The step's end: each rank ends each of its pending reads now if `ends()`, else in a
        later step; a read brings its rank's shard if the store has the object and `arrives()`
        (rank 0's shard stands for the rows)."""
        self.pending_reads += [(read, set(range(self.ranks))) for read in remote_jobs(meta).reads]
        reads: dict[int, dict[int, bool]] = {}
        for read, ranks_left in self.pending_reads:
            for rank in sorted(ranks_left):
                if not ends():
                    continue
                ranks_left.discard(rank)
                ok = read.key in self.store and arrives()
                if ok and rank == 0:
                    generation = self.store[read.key]
                    self.rows.update({r: (read.key, t, generation) for t, r in enumerate(read.rows)})
                reads.setdefault(rank, {})[read.read_id] = ok
        self.pending_reads = [(read, left) for read, left in self.pending_reads if left]
        if reads or up is not None:
            self.coord.update_connector_output(remote_report(reads=reads, up={} if up is None else {0: up}))

    @staticmethod
    def _prefill_tokens(prefill: ChunkPrefill) -> list[tuple[bytes, int]]:
        """(entry key, token index) of each prompt token of a prefill (key b"": not stored)."""
        if len(prefill.entries) == 2:  # SYS + chunk
            return [(e.key, t) for e in prefill.entries for t in range(e.num_tokens)]
        entry = prefill.entries[0]  # a chunk after a SYS not stored, or SYS alone
        skipped = len(prefill.token_ids) - entry.num_tokens
        return [(b"", t) for t in range(skipped)] + [(entry.key, t) for t in range(entry.num_tokens)]

    def _check_loads(self, meta, admitted: list[tuple[FakeRequest, int]]) -> None:
        expected = []
        for req, local in admitted:
            info = req.chunk_cache
            keys = ([(info.sys_hash, info.sys_len)] if info.sys_len else []) + list(
                zip(info.chunk_hashes, info.chunk_lens, strict=True)
            )
            tokens = [(key, t, self.generation) for key, n in keys for t in range(n)]
            expected += tokens[local : info.question_start]
        assert [self.rows.get(r) for r in meta.load_rows] == expected

    @rule(data=st.data(), sampled=st.booleans())
    @precondition(lambda self: self.prefills_ran or self.prefills_todo)
    def prefill_ends(self, data, sampled: bool) -> None:
        """A prefill ends: with its token if its forward ran, or early (never ran, or failed)."""
        rid = data.draw(st.sampled_from(sorted(self.prefills_todo.keys() | self.prefills_ran.keys())))
        ran = rid in self.prefills_ran
        prefill = self.prefills_ran.pop(rid, None) or self.prefills_todo.pop(rid)
        self.coord.request_finished(
            FakeRequest(rid, prefill.token_ids, num_output_tokens=int(ran and sampled))
        )

    @rule(data=st.data())
    @precondition(lambda self: self.waiting or self.running)
    def user_ends(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.waiting | self.running)))
        req = self.waiting.pop(rid, None) or self.running.pop(rid)
        self.coord.request_finished(req)

    @rule(data=st.data())
    @precondition(lambda self: self.running)
    def preempt(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.waiting[rid] = self.running.pop(rid)
        self.coord.on_preempted(self.waiting[rid])

    @rule()
    def reset(self) -> None:
        """A weight update: the store is emptied with the pool (in a deployment, its objects are
        named anew: `docs/design/design.md`, Tiers)."""
        self.coord.reset()
        self.generation += 1
        self.store = {}

    @invariant()
    def bookkeeping(self) -> None:
        coord = self.coord
        live_prefills = {**self.prefills_todo, **self.prefills_ran}
        assert coord.prefills.keys() == live_prefills.keys()
        check_bookkeeping(coord, live_prefills)
        assert coord.users.keys() == self.waiting.keys() | self.running.keys()

    def teardown(self) -> None:
        """Drain: with every prefill run and every ready request admitted, all requests load and
        the pool ends with no pins and no pending entries (no deadlock, no starvation). Steps run
        while reads are out, as vLLM's engine steps while it has requests (a read outliving every
        request ends in the next step the engine runs)."""
        for _ in range(40):
            busy = self.waiting or self.prefills_todo or self.prefills_ran or self.pending_reads
            if not (busy or self.coord.manager.refills):
                break
            for prefill in self.coord.plan():
                self.prefills_todo[prefill.request_id] = prefill
                self.prefill_generation[prefill.request_id] = self.generation
            prefills = list(self.prefills_todo.values()) + list(self.prefills_ran.values())
            self.prefills_todo, self.prefills_ran = {}, {}
            meta = self.coord.build_connector_meta(prefill_step(prefills))
            self._move(meta)
            self._save(meta, prefills)
            self._write_remote(meta)
            self._read_remote(meta, arrives=lambda: True, up=True if remote_tier(self.coord) else None)
            for prefill in prefills:
                self.coord.request_finished(
                    FakeRequest(prefill.request_id, prefill.token_ids, num_output_tokens=1)
                )
            admitted = []
            for rid, req in list(self.waiting.items()):
                n, _ = self.coord.get_num_new_matched_tokens(req, 0)
                if n is not None:
                    self.coord.update_state_after_alloc(req, blocks_for(req), n)
                    admitted.append((req, 0))
                    self.running[rid] = self.waiting.pop(rid)
            meta = self.coord.build_connector_meta(FakeOutput())
            self._move(meta)
            self._check_loads(meta, admitted)
        assert not self.waiting, f"requests never admitted: {sorted(self.waiting)}"
        for req in list(self.running.values()):
            self.coord.request_finished(req)
        check_drained(self.coord)


CoordinatorMachine.TestCase.settings = settings(
    max_examples=2000,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_coordinator_random_operations = CoordinatorMachine.TestCase


@pytest.fixture(autouse=True)
def _default_config(monkeypatch):
    """The coordinators here get the environment's settings (layout, LRU threshold): the defaults."""
    from vllm_ascend_chunk.config.settings import get_config

    for name in ("VLLM_CHUNK_CACHE_LAYOUT", "VLLM_CHUNK_CACHE_LRU_THRESHOLD"):
        monkeypatch.delenv(name, raising=False)
    get_config.cache_clear()
    yield
    get_config.cache_clear()
