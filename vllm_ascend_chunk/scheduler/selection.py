"""The `qattn:R[/M]` recovery mode: the document tokens the question attends to most, recomputed in
place (`docs/design/design.md`, Recovery).

A request in this mode loads its chunks as every chunk-path request does, then runs its own
prefill in three passes, each an ordinary chunked-prefill piece of the request (vLLM's causal
paged attention, no other kernel):

1. **scoring**: the question but its last token, `[R, N-1)`, over the plainly loaded region (the
   last token would sample). At one layer the workers add up, per region token, the attention
   weight every head of every computed question token gives it (`worker/scoring.py`), and report
   the sums.
2. **runs**: the region after C_1 is cut into windows of `w = ceil(count / M)` tokens, `count =
   round(R * region)` (at most the region after C_1, whose cached K/V is already full
   attention's); the `ceil(count / w)` windows with the highest sums (ties: the earlier) are
   recomputed in prompt order, adjacent ones as one run (cut where the layout's position shift
   changes: in `overlap`, at each document's start). For each run the scheduler moves the
   request's computed-token count back to the run's first token; the run overwrites the loaded
   K/V of its slots and attends causally to every slot before it: loaded tokens, and the runs
   before it already recomputed. That is the in-place plan of the HF reference
   (`harness/hf_recovery.py`, `qattn:r/m`). The runs after the one the request computes
   join its forward as batch rows of their own over the request's blocks when the step has room
   (`take`; the scheduler adds them): every backend writes a layer's K/V for all rows before any
   row attends at that layer, so each run sees the runs before it recomputed, as one after
   another would.
3. **question**: the count moves to R and the question is computed again (its scoring-pass K/V saw
   the plain region); the request then samples and decodes as usual.

Nothing is recomputed (the request is served as plain reuse, the scoring pass's K/V kept and only
the last token computed) when the question has one token, the request one document, or the
workers could not score (a forward replayed from a full CUDA graph runs no Python).

`cover:TAU[/RMAX[/RMIN]]` (`target` set) runs the same passes; its runs are the fewest of the
windows `qattn:RMAX/16` ranks that cover TAU of the question's attention over the region
(`cover_windows`), or, where RMAX does not reach TAU or a piece was not scored, the region after
C_1 whole (the guard); none at all (plain reuse) where C_1 alone covers TAU.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from vllm_ascend_chunk.core.request_info import ChunkSpans


class Phase(enum.Enum):
    SCORING = "scoring"
    """Computing `[R, N-1)`; each piece is scored by the workers."""
    AWAITING = "awaiting"
    """Every scoring piece scheduled, not every report back: the request is not scheduled."""
    RUNS = "runs"
    """Recomputing the selected runs, then the question."""
    DONE = "done"
    """Ordinary from here (the question's last pass, then decoding)."""


def ranked_windows(scores: list[float], select_from: int, width: int) -> list[tuple[int, int, float]]:
    """Windows `(start, end, summed score)` of `width` tokens from offset `select_from` on (the last one
    may be shorter), the best sum first (ties: the earlier)."""
    windows = [(s, min(s + width, len(scores))) for s in range(select_from, len(scores), width)]
    summed = [(start, end, math.fsum(scores[start:end])) for start, end in windows]
    return sorted(summed, key=lambda w: (-w[2], w[0]))


def merge_windows(windows: list[tuple[int, int, float]]) -> list[tuple[int, int]]:
    """The spans `[start, end)` of `windows`, in prompt order, adjacent ones merged."""
    merged: list[tuple[int, int]] = []
    for start, end, _ in sorted(windows):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def select_windows(scores: list[float], select_from: int, count: int, runs: int) -> list[tuple[int, int]]:
    """Region offsets `[start, end)` of the runs to recompute: windows of `ceil(count / runs)`
    tokens from offset `select_from` on, the `ceil(count / width)` best by summed score (ties: the
    earlier), adjacent ones merged, in prompt order."""
    width = -(-count // runs)
    return merge_windows(ranked_windows(scores, select_from, width)[: -(-count // width)])


@dataclass(frozen=True)
class Cover:
    """What a `cover` request recomputes (`cover_windows`)."""

    runs: list[tuple[int, int]]
    """Region offsets `[start, end)` recomputed, in prompt order."""
    coverage: float
    """The share of the question's attention over the region on exact tokens: the first
    document's and the recomputed windows' (at the ceiling, when it falls back)."""
    fallback: bool
    """The ceiling did not reach the target: every token after the first document is recomputed."""


def cover_windows(
    scores: list[float], select_from: int, target: float, floor: int, ceiling: int, runs: int
) -> Cover:
    """The fewest of the windows `select_windows(scores, select_from, ceiling, runs)` would rank (the
    best first), at least `ceil(floor / width)` of them, whose summed score with the first
    document's (offsets before `select_from`: already exact) covers `target` of the whole region's;
    where all `ceil(ceiling / width)` do not, the region after `select_from` whole (the guard). A region
    the question gives no weight is covered."""
    total = math.fsum(scores)
    width = -(-ceiling // runs) if ceiling else 1
    ranked = ranked_windows(scores, select_from, width)[: -(-ceiling // width)]
    least = -(-floor // width)
    on_exact = scores[:select_from]  # summed whole each time, so that covering every token gives `total`
    for taken in range(len(ranked) + 1):
        covered = math.fsum(on_exact)
        if taken >= least and covered >= target * total:
            return Cover(merge_windows(ranked[:taken]), covered / total if total > 0 else 1.0, False)
        if taken < len(ranked):
            on_exact = on_exact + scores[ranked[taken][0] : ranked[taken][1]]
    whole = [(select_from, len(scores))] if select_from < len(scores) else []
    return Cover(whole, covered / total, True)


def cut_runs(runs: list[tuple[int, int]], cuts: list[int]) -> list[tuple[int, int]]:
    """`runs` split at every offset in `cuts` strictly inside one (the same tokens, in order)."""
    pieces = []
    for start, end in runs:
        for cut in (c for c in cuts if start < c < end):
            pieces.append((start, cut))
            start = cut
        pieces.append((start, end))
    return pieces


@dataclass
class Selection:
    """One `qattn` request's passes (`Phase`), as token indices of the request."""

    sys_len: int
    question_start: int
    num_tokens: int
    count: int
    """Region tokens to recompute (before rounding up to whole windows)."""
    select_from: int
    """Region offset of C_2's first token: tokens before it are never selected."""
    max_runs: int
    cuts: list[int] = field(default_factory=list)
    """Region offsets no computed span crosses (`Layout.shift_bounds`)."""
    target: float = 0.0
    """`cover`: the share of the question's attention the runs must cover (0: `qattn`); `count`
    is then the ceiling."""
    floor: int = 0
    """`cover`: region tokens recomputed at least (before rounding up to whole windows)."""
    cover: Cover | None = None
    """`cover`: what was chosen (None until selected, or unscored)."""
    phase: Phase = Phase.SCORING
    scores: list[float] = field(default_factory=list)
    pending: int = 0
    """Scoring pieces sent to the workers and not yet reported."""
    failed: bool = False
    """A piece came back unscored: nothing is recomputed."""
    spans: list[tuple[int, int]] = field(default_factory=list)
    """Token spans computed after scoring: the runs, then the question."""
    cursor: int = -1
    """The span the request itself computes now."""
    taken: int = -1
    """The last span handed out as a row of its own (`take`)."""

    @classmethod
    def for_spans(
        cls,
        spans: ChunkSpans,
        fraction: float,
        max_runs: int,
        cuts: list[int] | None = None,
        target: float = 0.0,
        floor: float = 0.0,
    ) -> Selection | None:
        """The passes of a request with these spans (`qattn:fraction/max_runs`, or with `target`
        `cover:target/fraction/floor`), or None if it recomputes nothing."""
        region = sum(spans.chunk_lens)
        select_from = spans.chunk_lens[0] if spans.chunk_lens else 0
        count = min(round(fraction * region), region - select_from)
        if (count <= 0 and not (target and region > select_from)) or spans.question_len < 2:
            return None
        least = min(round(floor * region), count)
        return cls(
            spans.sys_len,
            spans.question_start,
            spans.num_tokens,
            count,
            select_from,
            max_runs,
            cuts or [],
            target,
            least,
        )

    @property
    def score_end(self) -> int:
        return self.num_tokens - 1

    @property
    def recomputed(self) -> int:
        """Region tokens the runs recompute (0 until selected)."""
        return sum(end - start for start, end in self.spans[:-1])

    def restart(self) -> None:
        """The request lost its blocks (preempted): everything starts again with its next load."""
        self.phase, self.scores, self.pending, self.failed = Phase.SCORING, [], 0, False
        self.spans, self.cursor, self.taken, self.cover = [], -1, -1, None

    def cap(self, num_computed: int, num_new: int) -> int:
        """Tokens the request may compute from `num_computed` on (`num_new` asked)."""
        if self.phase is Phase.SCORING:
            end = self.score_end
        elif self.phase is Phase.RUNS:  # (cursor -1: selected since `advance` last ran)
            end = self.spans[self.cursor][1] if self.cursor >= 0 else num_computed
        else:
            return 0 if self.phase is Phase.AWAITING else num_new
        return max(0, min(num_new, end - num_computed))

    def record_scheduled(self, start: int, num: int) -> bool:
        """A piece `[start, start + num)` was scheduled; True if the workers must score it."""
        if self.phase is not Phase.SCORING:
            return False
        self.pending += 1
        if start + num >= self.score_end:
            self.phase = Phase.AWAITING
        return True

    def reported(self, scores: list[float] | None) -> None:
        """The workers' sums for one scored piece (None: they could not score it)."""
        self.pending -= 1
        if scores is None:
            self.failed = True
        elif self.scores:
            self.scores = [a + b for a, b in zip(self.scores, scores, strict=True)]
        else:
            self.scores = list(scores)
        if self.phase is Phase.AWAITING and self.pending == 0:
            self._select()

    @property
    def fell_back(self) -> bool:
        """A `cover` request whose runs are the region after C_1 whole (the guard)."""
        return bool(self.target) and (self.failed or (self.cover is not None and self.cover.fallback))

    def _runs(self) -> list[tuple[int, int]]:
        """Region offsets of the runs: `qattn`'s windows, or `cover`'s (the region after C_1 whole
        when unscored)."""
        if not self.target:
            return select_windows(self.scores, self.select_from, self.count, self.max_runs)
        if self.failed:
            return [(self.select_from, self.question_start - self.sys_len)]
        self.cover = cover_windows(
            self.scores, self.select_from, self.target, self.floor, self.count, self.max_runs
        )
        return self.cover.runs

    def _select(self) -> None:
        runs = [] if self.failed and not self.target else self._runs()
        if not runs:
            self.phase = Phase.DONE  # plain reuse: the scoring pass's K/V stands
            return
        self.spans = [(self.sys_len + a, self.sys_len + b) for a, b in cut_runs(runs, self.cuts)]
        self.spans.append((self.question_start, self.num_tokens))
        self.phase = Phase.RUNS

    def advance(self, num_computed: int) -> int | None:
        """At the start of a schedule: the computed-token count the request moves to, if any (the
        first run's start, or the next span's once the current one is scheduled to its end)."""
        if self.phase is not Phase.RUNS:
            return None
        if self.cursor >= 0 and num_computed < self.spans[self.cursor][1]:
            return None
        self.cursor = max(self.cursor, self.taken) + 1
        if self.cursor == len(self.spans) - 1:
            self.phase = Phase.DONE
        return self.spans[self.cursor][0]

    def take(self, piece_end: int, budget: int, rows: int) -> list[tuple[int, int]]:
        """The runs after the current one that this step may compute as rows of their own, beside
        the request's piece that ends at `piece_end`: whole runs, in order, within `budget` tokens
        and `rows` rows; none unless that piece completes its run (a row attends to the K/V the
        rows before it write at each layer of the same forward, so runs computed together see
        what they would one after another). The question is always the request's own piece."""
        if self.phase is not Phase.RUNS or self.cursor < 0 or piece_end != self.spans[self.cursor][1]:
            return []
        taken = []
        for start, end in self.spans[self.cursor + 1 : -1]:
            if end - start > budget or len(taken) == rows:
                break
            taken.append((start, end))
            budget -= end - start
        self.taken = self.cursor + len(taken)
        return taken
