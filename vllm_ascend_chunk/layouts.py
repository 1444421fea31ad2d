"""Chunk layouts: the RoPE positions of a request's chunks and question (`docs/design.md`,
Semantics: positions), as the scheduler and the worker need them.

A cached chunk was computed right after SYS (positions `s..s+len(C_i)-1`). A layout says how the
request sees it from there: by moving the keys when they are loaded (`load_deltas`), or by
moving what the request computes (`question_shift`).
"""

from __future__ import annotations

from vllm_ascend_chunk.metadata import ChunkSpans


class Layout:
    name: str
    rotates_loaded_keys: bool
    """Whether loads re-rotate cached keys (the worker then needs the model's RoPE)."""

    def question_shift(self, spans: ChunkSpans) -> int:
        """How much lower than its index every token the request computes is positioned."""
        return 0

    def load_deltas(self, spans: ChunkSpans) -> list[int] | None:
        """RoPE delta of each token before the question, by which its cached key is rotated on
        load; None: keys are loaded as cached."""
        return None


class Overlap(Layout):
    """Every chunk at `s..`; the question right after the longest chunk."""

    name, rotates_loaded_keys = "overlap", False

    def question_shift(self, spans: ChunkSpans) -> int:
        return sum(spans.chunk_lens) - max(spans.chunk_lens, default=0)


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
