"""Chunk layouts: the RoPE positions of a request's chunks and question (`docs/design/design.md`,
Semantics: positions), as the scheduler and the worker need them.

A cached chunk was computed right after SYS (positions `s..s+len(C_i)-1`). A layout says how the
request sees it from there: by moving the keys when they are loaded (`load_deltas`), or by
moving what the request computes (`shift_at`): its question, and the document tokens a `qattn`
request recomputes in place.
"""

from __future__ import annotations

import itertools

from vllm_ascend_chunk.core.request_info import ChunkSpans


class Layout:
    name: str
    rotates_loaded_keys: bool
    """Whether loads re-rotate cached keys (the worker then needs the model's RoPE)."""

    def shift_at(self, spans: ChunkSpans, index: int) -> int:
        """How much lower than its index the token at `index` is positioned when the request
        computes it (a question token, or a document token recomputed in place)."""
        return 0

    def shift_bounds(self, spans: ChunkSpans) -> list[int]:
        """Region offsets (from SYS's end) where `shift_at` changes inside the region: a piece the
        request computes there must not cross one (the worker shifts a piece as a whole)."""
        return []

    def load_deltas(self, spans: ChunkSpans) -> list[int] | None:
        """RoPE delta of each token before the question, by which its cached key is rotated on
        load; None: keys are loaded as cached."""
        return None


class Overlap(Layout):
    """Every chunk at `s..`; the question right after the longest chunk."""

    name, rotates_loaded_keys = "overlap", False

    def shift_at(self, spans: ChunkSpans, index: int) -> int:
        if index >= spans.question_start:
            return sum(spans.chunk_lens) - max(spans.chunk_lens, default=0)
        before = 0  # tokens of the chunks before C_i, whose first token is positioned at `s`
        for n in spans.chunk_lens:
            if index < spans.sys_len + before + n:
                return before
            before += n
        return 0

    def shift_bounds(self, spans: ChunkSpans) -> list[int]:
        return list(itertools.accumulate(spans.chunk_lens[:-1]))


class Sequential(Layout):
    """The positions of the plain concatenation: C_i's keys move by the lengths before it."""

    name, rotates_loaded_keys = "sequential", True

    def load_deltas(self, spans: ChunkSpans) -> list[int]:
        deltas, offset = [0] * spans.sys_len, 0
        for n in spans.chunk_lens:
            deltas += [offset] * n
            offset += n
        return deltas


LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (Overlap(), Sequential())}
"""`VLLM_CHUNK_CACHE_LAYOUT` value → layout."""
