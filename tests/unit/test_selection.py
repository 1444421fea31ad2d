"""The `qattn` and `cover` recovery modes without an engine: the window choice (`cover`'s: the
fewest windows that reach the coverage, the floor, the ceiling and its fallback), a request's
passes as the coordinator drives them (caps, where it resumes, what the workers score, what it
counts), the workers' weights against a per-query softmax, and the merge of several workers'
reports. Through an engine,
against the HF reference: `tests/engine/test_chunk_engines.py`."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from tests.unit.test_coordinator import (
    FakeBlocks,
    FakeCachedRequests,
    FakeNewRequest,
    FakeOutput,
    blocks_for,
    coordinator,
    user_request,
)
from vllm_ascend_chunk.core.paging import slot_of
from vllm_ascend_chunk.core.request_info import ChunkSpans
from vllm_ascend_chunk.core.step import ChunkCacheWorkerMetadata
from vllm_ascend_chunk.metrics import forget_delivered, stats_payload
from vllm_ascend_chunk.scheduler.selection import (
    Cover,
    Phase,
    Selection,
    cover_windows,
    cut_runs,
    select_windows,
)
from vllm_ascend_chunk.worker.scoring import region_weights


def test_windows_are_the_best_sums_merged_in_prompt_order():
    scores = [9.0] * 4 + [0, 0, 5, 5, 1, 1, 6, 6, 0, 0, 2]
    # count 6 in 3 runs: windows of 2 from offset 4, sums 0, 10, 2, 12, 0, 2 (short last one);
    # the best three: 10-12, 6-8 and 8-10 (2, the earlier of a tie), merged.
    assert select_windows(scores, 4, 6, 3) == [(6, 12)]
    assert select_windows(scores, 4, 3, 3) == [(6, 7), (10, 12)]  # tokens 10, 11, then 6 (tie with 7)
    assert select_windows(scores, 4, 2, 1) == [(10, 12)]  # C_1 (offsets < 4) never, however high


def test_window_ties_and_short_last_window():
    assert select_windows([0.0] * 10, 3, 4, 2) == [(3, 7)]  # ties: the earliest windows
    assert select_windows([0, 0, 0, 0, 0, 0, 0, 1.0], 2, 5, 2) == [(2, 8)]  # windows of 3: 2-5, 5-8
    assert select_windows([0, 0, 1.0, 0, 0, 0, 0, 3.0], 1, 3, 3) == [(1, 3), (7, 8)]


COVER_SCORES = [1.0] * 4 + [0, 0, 4, 4, 0, 0, 2, 2, 1, 1, 0, 0]
"""C_1 (offsets 0-3) holds 4 of 18; windows of 2 from offset 4 sum 0, 8, 0, 4, 2, 0."""


@pytest.mark.parametrize(
    "target, runs, coverage",
    [
        (0.2, [], 4 / 18),  # C_1, exact already, covers it: nothing recomputed
        (0.5, [(6, 8)], 12 / 18),  # 4 + 8 >= 9: one window
        (0.8, [(6, 8), (10, 12)], 16 / 18),
        (0.95, [(6, 8), (10, 14)], 1.0),  # every window the ceiling allows, merged where adjacent
    ],
)
def test_cover_takes_the_fewest_best_windows_that_reach_the_target(target, runs, coverage):
    got = cover_windows(COVER_SCORES, 4, target, 0, 6, 3)  # ceiling 6 in 3 runs: 3 windows of 2
    assert got == Cover(runs, pytest.approx(coverage), False)
    assert select_windows(COVER_SCORES, 4, 6, 3) == [(6, 8), (10, 14)]  # the same ranking: qattn's


def test_cover_floor_and_ceiling():
    # The floor: at least ceil(3 / 2) = 2 windows, however little the target asks.
    assert cover_windows(COVER_SCORES, 4, 0.2, 3, 6, 3) == Cover(
        [(6, 8), (10, 12)], pytest.approx(16 / 18), False
    )
    # The ceiling, 4 tokens (2 windows of 2), reaches 16 of 18: below 0.95, the region after C_1 whole.
    assert cover_windows(COVER_SCORES, 4, 0.95, 0, 4, 2) == Cover([(4, 16)], pytest.approx(16 / 18), True)
    assert cover_windows(COVER_SCORES, 4, 1.0, 0, 6, 3).fallback is False  # exactly the whole mass
    # No ceiling: C_1 alone decides.
    assert cover_windows(COVER_SCORES, 4, 0.2, 0, 0, 16) == Cover([], pytest.approx(4 / 18), False)
    assert cover_windows(COVER_SCORES, 4, 0.5, 0, 0, 16) == Cover([(4, 16)], pytest.approx(4 / 18), True)


def test_cover_ties_and_a_region_without_attention():
    flat = [0.0] * 4 + [1.0] * 8
    assert cover_windows(flat, 4, 0.5, 0, 4, 2) == Cover([(4, 8)], 0.5, False)  # ties: the earliest
    assert cover_windows([0.0] * 12, 4, 1.0, 0, 4, 2) == Cover([], 1.0, False)  # nothing to cover
    assert cover_windows([1.0] * 4, 4, 1.0, 0, 0, 16) == Cover([], 1.0, False)  # one document


def test_runs_are_cut_only_inside():
    assert cut_runs([(2, 9), (12, 14)], [4, 9, 13]) == [(2, 4), (4, 9), (12, 13), (13, 14)]
    assert cut_runs([(2, 9)], []) == [(2, 9)] and cut_runs([], [3]) == []


SPANS = ChunkSpans(sys_len=3, chunk_lens=[4, 6, 5], question_len=4)
"""Region tokens 3..17 (C_1 3..6), question 18..21: N = 22."""


def test_nothing_to_recompute():
    assert Selection.for_spans(SPANS, 0.01, 4) is None  # round(0.15) = 0 tokens
    assert Selection.for_spans(msgspec.structs.replace(SPANS, chunk_lens=[9]), 0.5, 4) is None  # C_1 only
    assert Selection.for_spans(msgspec.structs.replace(SPANS, question_len=1), 0.5, 4) is None  # no scoring
    assert Selection.for_spans(SPANS, 1.0, 4).count == 11  # at most the region after C_1


def test_the_passes_of_one_request():
    sel = Selection.for_spans(SPANS, 0.3, 2)  # count round(4.5) = 4, windows of 2
    assert (sel.count, sel.select_from, sel.score_end) == (4, 4, 21)
    assert sel.cap(18, 100) == 3 and sel.cap(18, 2) == 2  # scoring stops before the last token
    assert sel.record_scheduled(18, 2) and sel.phase is Phase.SCORING  # a chunked-prefill piece
    assert sel.record_scheduled(20, 1) and sel.phase is Phase.AWAITING and sel.cap(21, 1) == 0
    assert sel.advance(21) is None  # nothing until every piece is reported
    region = [0.0] * 15
    region[9], region[12] = 1.0, 2.0  # windows from offset 4: [8, 10) and [12, 14)
    sel.reported(region)
    assert sel.phase is Phase.AWAITING
    sel.reported([0.0] * 8 + [0.5] + [0.0] * 6)  # the second piece's sums add up
    assert sel.phase is Phase.RUNS and sel.spans == [(3 + 8, 3 + 10), (3 + 12, 3 + 14), (18, 22)]
    assert sel.recomputed == 4
    assert sel.advance(21) == 11 and sel.cap(11, 100) == 2 and sel.cap(11, 1) == 1
    assert sel.advance(12) is None  # half the run scheduled: continue
    assert sel.advance(13) == 15 and sel.phase is Phase.RUNS
    assert sel.advance(17) == 18 and sel.phase is Phase.DONE  # the question again
    assert sel.cap(18, 100) == 100 and not sel.record_scheduled(18, 4) and sel.advance(22) is None


def test_later_runs_are_taken_as_rows_of_their_own_when_the_current_one_completes():
    def selected() -> Selection:
        sel = Selection.for_spans(SPANS, 0.4, 4)  # count 6 in windows of 2 from offset 4
        sel.record_scheduled(18, 3)
        sel.reported([0.0] * 4 + [1.0, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0])
        return sel

    sel = selected()
    assert sel.spans == [(7, 9), (11, 13), (15, 17), (18, 22)]
    assert sel.take(9, 100, 8) == []  # before `advance`: no run is the request's yet
    assert sel.advance(21) == 7
    assert sel.take(8, 100, 8) == []  # the request's piece stops inside its run
    assert sel.take(9, 1, 8) == []  # the next run (2 tokens) does not fit
    assert sel.take(9, 3, 8) == [(11, 13)] and sel.advance(9) == 15  # the one after is next
    assert sel.take(17, 100, 8) == [] and sel.advance(17) == 18 and sel.phase is Phase.DONE
    sel = selected()
    assert sel.advance(21) == 7 and sel.take(9, 100, 1) == [(11, 13)]  # one row left
    sel = selected()
    sel.advance(21)
    # Every run but the question's pass: the question is always the request's own piece.
    assert sel.take(9, 100, 8) == [(11, 13), (15, 17)] and sel.advance(9) == 18
    assert sel.phase is Phase.DONE
    sel.restart()
    assert (sel.cursor, sel.taken) == (-1, -1)


def test_an_unscored_piece_serves_plain_reuse():
    sel = Selection.for_spans(SPANS, 0.3, 2)
    sel.record_scheduled(18, 3)
    sel.reported(None)
    assert sel.phase is Phase.DONE and sel.advance(21) is None and sel.cap(21, 1) == 1


def scored_cover(fraction: float, target: float, scores: list[float] | None) -> Selection:
    """A `cover` selection of SPANS (region 15, C_1 4) after its one scoring piece."""
    sel = Selection.for_spans(SPANS, fraction, 2, target=target)
    sel.record_scheduled(18, 3)
    sel.reported(scores)
    return sel


def test_the_passes_of_a_cover_request():
    scores = [0.0] * 15
    scores[9] = 1.0  # ceiling round(0.4 * 15) = 6 in windows of 3 from offset 4: [7, 10) covers all
    sel = scored_cover(0.4, 0.9, scores)
    assert sel.spans == [(3 + 7, 3 + 10), (18, 22)] and sel.cover.coverage == 1.0 and not sel.fell_back
    sel = scored_cover(0.4, 0.9, [1.0] * 15)  # 4 + 6 of 15 at the ceiling: the guard
    assert sel.spans == [(3 + 4, 3 + 15), (18, 22)] and sel.fell_back
    assert sel.cover.coverage == pytest.approx(10 / 15) and sel.recomputed == 11
    sel = scored_cover(0.4, 0.25, [1.0] * 15)  # C_1 covers 4 of 15: plain reuse, scores kept
    assert sel.phase is Phase.DONE and sel.spans == [] and not sel.fell_back
    assert sel.cover.coverage == pytest.approx(4 / 15) and sel.advance(21) is None


def test_an_unscored_cover_request_computes_every_document():
    sel = scored_cover(0.4, 0.5, None)
    assert sel.fell_back and sel.cover is None and sel.spans == [(7, 18), (18, 22)]
    sel = Selection.for_spans(SPANS, 0.0, 16, target=0.5)  # no ceiling: still scored, may fall back
    assert sel is not None and sel.count == 0
    assert Selection.for_spans(msgspec.structs.replace(SPANS, chunk_lens=[9]), 0.5, 4, target=0.5) is None
    assert Selection.for_spans(msgspec.structs.replace(SPANS, question_len=1), 0.5, 4, target=0.5) is None
    assert Selection.for_spans(SPANS, 1.0, 4, target=0.5, floor=0.1).floor == 2  # round(1.5)


def test_restart_after_preemption():
    sel = Selection.for_spans(SPANS, 0.3, 2)
    sel.record_scheduled(18, 3)
    sel.reported([1.0] * 15)
    assert sel.phase is Phase.RUNS
    sel.restart()
    assert (sel.phase, sel.scores, sel.pending, sel.spans, sel.cursor) == (Phase.SCORING, [], 0, [], -1)


def qattn_request(rid: str, mode: str = "0.5/2", question_len: int = 3, cover: float = 0.0):
    request = user_request(rid, [b"d0", b"d1", b"d2"], sys_len=2, question_len=question_len)  # 2 + 3+4+5 + Q
    fraction, runs = mode.split("/")
    info = msgspec.structs.replace(request.chunk_cache, fraction=float(fraction), runs=int(runs), cover=cover)
    request.chunk_cache = info
    return request


def make_resident(coord) -> None:
    """Plan the waiting requests and let their chunk prefills finish."""
    for prefill in coord.plan():
        for entry in prefill.entries:
            coord.manager.mark_resident(entry)
        coord.prefills.pop(prefill.request_id)
    coord.build_connector_meta(FakeOutput())


def test_the_coordinator_drives_the_passes():
    coord = coordinator(num_pages=16)
    request = qattn_request("q")
    coord.on_new_request(request)
    assert request.skip_reading_prefix_cache
    make_resident(coord)
    assert coord.get_num_new_matched_tokens(request, 0) == (14, False)
    # Admitted: the load, and the scoring piece [14, 16) (the question but its last token).
    assert coord.recompute.token_cap(request, 3, 14) == 2
    blocks = blocks_for(request)
    coord.update_state_after_alloc(request, blocks, 14)
    request.num_computed_tokens = 14
    out = FakeOutput(num_scheduled_tokens={"q": 2}, scheduled_new_reqs=[FakeNewRequest("q", (blocks.ids,))])
    meta = coord.build_connector_meta(out)
    spec = meta.scores["q"]
    assert (spec.piece_start, spec.region) == (14, (2, 14))
    assert spec.key_slots == [slot_of(blocks.ids, 4, t) for t in range(16)]
    request.num_computed_tokens = 16
    coord.recompute.reposition([request])
    assert request.num_computed_tokens == 16 and coord.recompute.token_cap(request, 1, 16) == 0  # awaiting
    # Region 12 tokens, C_1 = 3: count 6 in windows of 3 from offset 3; the best: 6-9 and 9-12.
    scores = [0.0] * 12
    scores[7], scores[10] = 1.0, 1.0
    coord.update_connector_output(ChunkCacheWorkerMetadata(scores={"q": scores, "other": [1.0]}))
    coord.recompute.reposition([request])
    assert request.num_computed_tokens == 8 and coord.recompute.token_cap(request, 100, 8) == 6  # one run
    assert not coord.build_connector_meta(FakeOutput(num_scheduled_tokens={"q": 6})).scores
    assert coord.manager.stats.selections == 1 and coord.manager.stats.selected_tokens == 6
    request.num_computed_tokens = 14
    coord.recompute.reposition([request])
    assert request.num_computed_tokens == 14 and coord.recompute.token_cap(request, 100, 14) == 100
    coord.on_preempted(request)
    assert coord.users["q"].selection.phase is Phase.SCORING


def score_one(coord, request, scores: list[float]) -> None:
    """Load `request`, schedule its scoring piece [14, 16) and report `scores`."""
    blocks = blocks_for(request)
    coord.update_state_after_alloc(request, blocks, 14)
    request.num_computed_tokens = 14
    coord.build_connector_meta(
        FakeOutput({request.request_id: 2}, [FakeNewRequest(request.request_id, (blocks.ids,))])
    )
    request.num_computed_tokens = 16
    coord.update_connector_output(ChunkCacheWorkerMetadata(scores={request.request_id: scores}))


def test_the_coordinator_counts_coverage_and_fallbacks():
    """Region 12 tokens, C_1 3, ceiling round(0.25 * 12) = 3 windows of 1: the first request's
    best two cover 9 of 10; the second's three cover 6 of 12 (< 0.9): every document computed."""
    coord = coordinator(num_pages=16)
    covered, guarded = qattn_request("c", "0.25/16", cover=0.9), qattn_request("g", "0.25/16", cover=0.9)
    for request in (covered, guarded):
        coord.on_new_request(request)
        assert request.skip_reading_prefix_cache and coord.private(request.request_id)
    make_resident(coord)
    scores = [0.0] * 12
    scores[0], scores[5], scores[8] = 1.0, 5.0, 4.0
    score_one(coord, covered, scores)
    score_one(coord, guarded, [1.0] * 12)
    assert coord.users["c"].selection.spans == [(7, 8), (10, 11), (14, 17)]
    assert coord.users["g"].selection.spans == [(5, 14), (14, 17)]
    stats = coord.manager.stats
    assert (stats.coverage, stats.cover_fallbacks) == ([1.0, 0.5], 1)
    coord.recompute.reposition([covered, guarded])
    assert (stats.selections, stats.selected_tokens) == (2, 2 + 9)
    payload = stats_payload(coord.manager)
    assert payload["coverage"] == [1.0, 0.5] and payload["increments"]["cover_fallbacks"] == 1
    stats.coverage.append(0.7)  # observed after the payload was made: sent with the next one
    forget_delivered(coord.manager, payload)
    assert stats.coverage == [0.7]
    # A one-token question: the frontend joined C_2, C_3 to it (`frontend.recovery.joined_docs`).
    unscored = qattn_request("u", "0.25/16", cover=0.9)
    unscored.chunk_cache = msgspec.structs.replace(unscored.chunk_cache, recovered=2)
    coord.on_new_request(unscored)
    assert stats.cover_fallbacks == 2 and coord.private("u")


def test_in_overlap_a_run_is_cut_at_each_document_and_shifted_by_its_own(chunk_env):
    """Every document starts at position `s` in `overlap`: the worker lowers a piece's positions
    by one shift, so a run over two documents is two pieces, each shifted by the lengths of the
    documents before its own."""
    chunk_env(VLLM_CHUNK_CACHE_LAYOUT="overlap")
    coord = coordinator(num_pages=16)
    request = qattn_request("q")  # SYS 0-1, C_1 2-4, C_2 5-8, C_3 9-13, question 14-16
    coord.on_new_request(request)
    make_resident(coord)
    blocks = blocks_for(request)
    coord.update_state_after_alloc(request, blocks, 14)
    request.num_computed_tokens = 14
    meta = coord.build_connector_meta(
        FakeOutput({"q": 2}, scheduled_new_reqs=[FakeNewRequest("q", (blocks.ids,))])
    )
    assert meta.position_shifts == {"q": 7}  # the question after the longest document: 14 - (2 + 5)
    request.num_computed_tokens = 16
    scores = [0.0] * 12
    scores[7], scores[10] = 1.0, 1.0  # the run of region offsets 6-12: tokens 8-13, over C_2 and C_3
    coord.update_connector_output(ChunkCacheWorkerMetadata(scores={"q": scores}))
    assert coord.users["q"].selection.spans == [(8, 9), (9, 14), (14, 17)]
    pieces = []
    for _ in range(3):
        coord.recompute.reposition([request])
        first = request.num_computed_tokens
        num = coord.recompute.token_cap(request, 100, first)
        pieces.append((first, num, coord.build_connector_meta(FakeOutput({"q": num})).position_shifts["q"]))
        request.num_computed_tokens = first + num
    assert pieces == [(8, 1, 3), (9, 5, 7), (14, 100, 7)]  # C_2's last token at 5 + 3 - 3, C_3 from 2
    assert coord.manager.stats.selected_tokens == 6


def test_the_recovery_path_is_idle_unless_a_request_selects(chunk_env):
    """With no `qattn`/`cover` request the scheduler's recovery calls return at once: nothing
    capped, repositioned, computed as a batched run or scored; a selecting request turns them on until
    it finishes."""
    coord = coordinator(num_pages=16)
    plain = user_request("p", [b"d0", b"d1"], sys_len=2, question_len=3)
    coord.on_new_request(plain)
    assert not coord.recompute.active
    assert coord.recompute.token_cap(plain, 5, 0) == 5
    assert coord.recompute.batched_runs({"p": 5}, budget=100, rows=4) == []
    coord.recompute.reposition([plain])
    assert plain.num_computed_tokens == 0 and coord.recompute.take_score_specs({"p": 5}) == {}
    nothing = qattn_request("n", question_len=1)  # a 1-token question: nothing is recomputed
    coord.on_new_request(nothing)
    assert coord.users["n"].selection is None and not coord.recompute.active
    assert coord.recompute.token_cap(nothing, 5, 0) == 5
    request = qattn_request("q")
    coord.on_new_request(request)
    assert coord.recompute.active and coord.recompute.selecting == {"q"}
    assert coord.recompute.token_cap(nothing, 5, 0) == 5
    coord.request_finished(request)
    assert not coord.recompute.active


def test_a_batched_run_has_its_own_position_shift(chunk_env):
    """The run over C_3 computed as a row of its own, beside the request's piece over C_2's last
    token: each lowered by its own document's shift; the request then computes its question."""
    chunk_env(VLLM_CHUNK_CACHE_LAYOUT="overlap")
    coord = coordinator(num_pages=16)
    request = qattn_request("q")
    coord.on_new_request(request)
    make_resident(coord)
    blocks = blocks_for(request)
    coord.update_state_after_alloc(request, blocks, 14)
    request.num_computed_tokens = 14
    coord.build_connector_meta(FakeOutput({"q": 2}, scheduled_new_reqs=[FakeNewRequest("q", (blocks.ids,))]))
    request.num_computed_tokens = 16
    scores = [0.0] * 12
    scores[7], scores[10] = 1.0, 1.0
    coord.update_connector_output(ChunkCacheWorkerMetadata(scores={"q": scores}))
    coord.recompute.reposition([request])
    assert request.num_computed_tokens == 8 and coord.recompute.token_cap(request, 100, 8) == 1
    assert coord.recompute.batched_runs({"q": 1}, budget=4, rows=4) == []  # 5 tokens do not fit
    (run,) = coord.recompute.batched_runs({"q": 1}, budget=100, rows=4)
    assert (run.request_id, run.parent, run.start, run.end) == ("q#run9", request, 9, 14)
    meta = coord.build_connector_meta(FakeOutput({"q": 1, "q#run9": 5}))
    assert meta.position_shifts == {"q": 3, "q#run9": 7} and not meta.scores
    request.num_computed_tokens = 9
    coord.recompute.reposition([request])
    assert request.num_computed_tokens == 14 and coord.users["q"].selection.phase is Phase.DONE
    assert coord.build_connector_meta(FakeOutput({"q": 3})).position_shifts == {"q": 7}


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 3)])
@pytest.mark.parametrize("block", [1, 3, 5, 64, None])
def test_region_weights_are_each_query_s_softmax_summed(heads, kv_heads, block):
    """Whatever the block of keys scored at a time (the blocks need not align with the region;
    64 and the default hold every key: one softmax)."""
    torch.manual_seed(0)
    piece_start, n, dim = 7, 5, 8
    query, keys = torch.randn(n, heads, dim), torch.randn(piece_start + n, kv_heads, dim)
    region = (2, 9)
    want = torch.zeros(region[1] - region[0])
    for i in range(n):
        for h in range(heads):
            k = keys[: piece_start + i + 1, h // (heads // kv_heads)]
            weights = torch.softmax(k @ query[i, h] * 0.3, dim=0)
            want += torch.nn.functional.pad(weights, (0, piece_start + n))[region[0] : region[1]]
    got = region_weights(query, lambda lo, hi: keys[lo:hi], piece_start, region, 0.3, block)
    torch.testing.assert_close(got, want)


def test_region_weights_read_bounded_blocks_of_a_32k_prompt():
    """A question of 64 tokens after 32K document tokens, 32 query heads over 8 KV heads of 128
    (an 8B model's layer): keys are read in blocks of `key_block` (8,192 here), and the scoring's
    memory grows by less than 320 MiB (before: 1 GiB, the keys expanded to every head in float32
    and the [heads, queries, keys] logits twice)."""
    code = textwrap.dedent(
        """
        import resource, torch
        from vllm_ascend_chunk.worker.scoring import key_block, region_weights
        torch.manual_seed(0)
        piece_start, n, heads, kv_heads, dim = 32768, 64, 32, 8, 128
        keys = torch.randn(piece_start + n, kv_heads, dim, dtype=torch.bfloat16)
        query = torch.randn(n, heads, dim, dtype=torch.bfloat16)
        widest = []
        def read(lo, hi):
            widest.append(hi - lo)
            return keys[lo:hi]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        total = region_weights(query, read, piece_start, (16, piece_start), 0.1)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        assert max(widest) == key_block(heads, n, kv_heads, dim) == 8192, max(widest)
        assert torch.isfinite(total).all() and 0 < float(total.sum()) <= n * heads + 1e-3
        print(f"grown {grown:.0f} MiB")
        assert grown < 320, grown
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_workers_reports_add_up():
    a = ChunkCacheWorkerMetadata(scores={"x": [1.0, 2.0], "y": [1.0]})
    b = ChunkCacheWorkerMetadata(scores={"x": [0.5, 0.5], "y": None, "z": [3.0]})
    assert a.aggregate(b).scores == {"x": [1.5, 2.5], "y": None, "z": [3.0]}


def test_a_qattn_request_is_never_loaded_by_another_connector():
    """P/D decode instance: what a token-keyed connector holds under a `qattn` request's ids
    may be another mode's KV, or its own before the runs were recomputed: the request is the
    chunk cache's alone (other connectors never see it) and keeps its passes."""
    coord = coordinator(num_pages=16)
    request = qattn_request("q")
    coord.on_new_request(request)
    assert coord.private("q")
    with pytest.raises(AssertionError, match="served here"):
        coord.load_elsewhere(request, 17)
    assert (
        coord.users["q"].selection.phase is Phase.SCORING and coord.recompute.token_cap(request, 3, 14) == 2
    )


def test_the_keys_are_read_from_the_blocks_of_a_resumed_request():
    """Preempted after its load, the request is loaded again into new blocks, which the scheduler
    output then lists whole (resumed), and later pieces add blocks to those: the scores read its
    keys there."""
    coord = coordinator(num_pages=16)
    request = qattn_request("r", question_len=8)  # N = 22: scoring [14, 21)
    coord.on_new_request(request)
    make_resident(coord)
    coord.update_state_after_alloc(request, FakeBlocks([1, 2, 3, 4]), 14)
    coord.build_connector_meta(FakeOutput())
    coord.on_preempted(request)
    make_resident(coord)
    blocks = [7, 8, 9, 10]
    coord.update_state_after_alloc(request, FakeBlocks(blocks), 14)
    request.num_computed_tokens = 14
    resumed = FakeCachedRequests(["r"], {"r"}, [(blocks,)], [14])
    spec = coord.build_connector_meta(FakeOutput({"r": 2}, scheduled_cached_reqs=resumed)).scores["r"]
    assert spec.key_slots == [slot_of(blocks, 4, t) for t in range(16)]
    request.num_computed_tokens = 16
    later = FakeCachedRequests(["r"], set(), [([11, 12],)], [16])
    spec = coord.build_connector_meta(FakeOutput({"r": 5}, scheduled_cached_reqs=later)).scores["r"]
    assert spec.key_slots == [slot_of([*blocks, 11, 12], 4, t) for t in range(21)]
