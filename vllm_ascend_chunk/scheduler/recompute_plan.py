"""In-place recompute (`qattn`, `cover`) on the scheduler side: each such request's `Selection`
says how far it may compute, where it continues and which of its runs join a step as rows of
their own; the question pieces it computes are scored by the workers, whose sums come back with
the step's report (`scheduler/selection.py` has the passes)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_ascend_chunk.core.layouts import Layout
from vllm_ascend_chunk.core.paging import slot_of
from vllm_ascend_chunk.core.stats import ChunkCacheStats
from vllm_ascend_chunk.core.step import ScoreSpec
from vllm_ascend_chunk.scheduler.requests import UserRequest
from vllm_ascend_chunk.scheduler.selection import Phase, Selection

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.chunk_cache")


@dataclass(frozen=True)
class BatchedRun:
    """A `qattn` run computed as a batch row of its own, beside its request's piece: the
    request's tokens and blocks, computed from `start` to `end` (`RecomputePlanner.batched_runs`),
    its positions lowered by `shift`."""

    request_id: str
    parent: Request
    start: int
    end: int
    shift: int


class RecomputePlanner:
    """The whole recovery path of the scheduler side: vLLM's scheduler asks it directly
    (`vllm_adapter.scheduler`); with no request selecting, every call returns at once."""

    def __init__(
        self, users: dict[str, UserRequest], layout: Layout, block_size: int, stats: ChunkCacheStats
    ) -> None:
        self.users = users
        """The coordinator's chunk-path requests (read here; their selections and blocks kept)."""
        self.layout = layout
        self.block_size = block_size
        self.stats = stats
        self.selecting: set[str] = set()
        """The requests with a selection (`attach`, until `detach`)."""
        self._shifts: dict[str, int] = {}
        """The position shifts of the step's batched runs (`take_shifts`)."""

    @property
    def active(self) -> bool:
        """Some request recomputes in place: the scheduler's recovery calls have work."""
        return bool(self.selecting)

    def attach(self, user: UserRequest) -> None:
        """A new chunk-path request: its `qattn` (or `cover`) passes, if it may recompute
        anything in place."""
        info = user.info
        if not (info.fraction or info.cover):
            return
        cuts = self.layout.shift_bounds(info)
        user.selection = Selection.for_spans(info, info.fraction, info.runs, cuts, info.cover, info.floor)
        if user.selection is not None:  # None: nothing to recompute (one document, a 1-token question)
            self.selecting.add(user.request.request_id)

    def detach(self, request_id: str) -> None:
        """The request is finished: nothing of it is planned again."""
        self.selecting.discard(request_id)

    def _selecting(self, request_id: str) -> UserRequest | None:
        return self.users.get(request_id) if request_id in self.selecting else None

    def take_shifts(self) -> dict[str, int]:
        """The position shifts of the batched runs handed out since the last step was built."""
        shifts, self._shifts = self._shifts, {}
        return shifts

    def track_blocks(self, scheduler_output) -> None:
        """Records the blocks the step's scheduler output gives requests with a selection (their
        scores read their keys)."""
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if (user := self._selecting(rid)) is None or not new_blocks:
                continue
            if rid in cached.resumed_req_ids:  # preempted, then given blocks anew: all of them
                user.block_ids = list(new_blocks[0])
            else:
                user.block_ids += new_blocks[0]

    def take_score_specs(self, num_scheduled_tokens: dict[str, int]) -> dict[str, ScoreSpec]:
        """The question pieces the workers score this step."""
        specs = {}
        if not self.selecting:
            return specs
        for rid, num in num_scheduled_tokens.items():
            if (user := self._selecting(rid)) is None:
                continue
            start = user.request.num_computed_tokens
            if user.selection.record_scheduled(start, num):
                slots = [slot_of(user.block_ids, self.block_size, t) for t in range(start + num)]
                region = (user.info.sys_len, user.info.question_start)
                specs[rid] = ScoreSpec(piece_start=start, key_slots=slots, region=region)
        return specs

    def token_cap(self, request: Request, num_new_tokens: int, num_computed_tokens: int) -> int:
        """How many of `num_new_tokens` the request may compute from `num_computed_tokens` on
        (patch `vllm.v1.core.sched.scheduler`, through `hooks.cap_new_tokens`)."""
        if not self.selecting or (user := self._selecting(request.request_id)) is None:
            return num_new_tokens
        return user.selection.cap(num_computed_tokens, num_new_tokens)

    def batched_runs(self, num_scheduled_tokens: dict[str, int], budget: int, rows: int) -> list[BatchedRun]:
        """After vLLM scheduled this step: the further runs of `qattn` requests that are computed
        in it as rows of their own (`Selection.take`), within `budget` tokens and `rows` rows."""
        batched = []
        if not self.selecting:
            return batched
        for rid, num in list(num_scheduled_tokens.items()):
            if (user := self._selecting(rid)) is None:
                continue
            for start, end in user.selection.take(user.request.num_computed_tokens + num, budget, rows):
                shift = self.layout.shift_at(user.info, start)
                batched.append(BatchedRun(f"{rid}#run{start}", user.request, start, end, shift))
                self._shifts[batched[-1].request_id] = shift
                self.stats.batched_runs += 1
                budget, rows = budget - (end - start), rows - 1
        return batched

    def reposition(self, running: Sequence[Request]) -> None:
        """Start of a schedule: move running `qattn` requests to the span they compute next."""
        if not self.selecting:
            return
        for request in running:
            if (user := self._selecting(request.request_id)) is None:
                continue
            start = user.selection.advance(request.num_computed_tokens)
            if start is not None:
                request.num_computed_tokens = start
                if user.selection.cursor == 0:
                    self.stats.selections += 1
                    self.stats.selected_tokens += user.selection.recomputed

    def scored(self, scores: dict[str, list[float] | None]) -> None:
        """The workers' sums for the pieces scored in a step (None: not scored)."""
        for rid, sums in scores.items():
            user = self._selecting(rid)
            if user is None or not user.selection.pending:
                continue
            user.selection.reported(sums)
            if sums is None:
                served = "every document computed" if user.selection.target else "without recompute"
                logger.warning("Chunk Cache: %s could not be scored; served with %s", rid, served)
            if user.selection.phase is not Phase.AWAITING:
                self._count_cover(user.selection)

    def _count_cover(self, selection: Selection) -> None:
        """A request's selection was just made: a `cover` request's coverage and fallback."""
        if selection.cover is not None:
            self.stats.coverage.append(selection.cover.coverage)
        self.stats.cover_fallbacks += selection.fell_back
