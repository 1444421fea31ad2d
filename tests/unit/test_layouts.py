"""The layouts' position rules against hand-computed positions (`docs/design/design.md`, Semantics)."""

import pytest

from vllm_ascend_chunk.config.settings import ChunkCacheConfig
from vllm_ascend_chunk.config.variables import ChunkCacheConfigError
from vllm_ascend_chunk.core.layouts import LAYOUTS
from vllm_ascend_chunk.core.request_info import ChunkSpans

SPANS = ChunkSpans(sys_len=2, chunk_lens=[3, 5, 1], question_len=2)


def test_overlap_lowers_what_the_request_computes_by_all_but_the_longest_chunk():
    overlap = LAYOUTS["overlap"]
    # Question index 11 sits at s + max len = 7: lowered by (3 + 5 + 1) - 5 = 4.
    assert overlap.shift_at(SPANS, SPANS.question_start) == 4 and overlap.load_deltas(SPANS) is None
    assert overlap.shift_at(ChunkSpans(sys_len=2, chunk_lens=[], question_len=1), 2) == 0
    assert not overlap.rotates_loaded_keys


def test_overlap_positions_a_recomputed_document_token_from_s_within_its_chunk():
    """A `qattn` run recomputes document tokens in place: C_i's k-th token sits at s + k, so its
    shift is the length of the chunks before it, and it changes at each chunk's start."""
    overlap = LAYOUTS["overlap"]
    # Indices: SYS 0-1, C_1 2-4, C_2 5-9, C_3 10, question 11-12.
    shifts = [overlap.shift_at(SPANS, i) for i in range(SPANS.num_tokens)]
    assert shifts == [0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 8, 4, 4]
    assert [i - d for i, d in enumerate(shifts)][:11] == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 2]
    assert overlap.shift_bounds(SPANS) == [3, 8]  # region offsets of C_2's and C_3's first tokens
    sequential = LAYOUTS["sequential"]
    assert {sequential.shift_at(SPANS, i) for i in range(SPANS.num_tokens)} == {0}
    assert sequential.shift_bounds(SPANS) == []


def test_sequential_moves_each_cached_key_by_the_lengths_before_its_chunk():
    sequential = LAYOUTS["sequential"]
    assert sequential.load_deltas(SPANS) == [0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 8]
    assert sequential.shift_at(SPANS, SPANS.question_start) == 0 and sequential.rotates_loaded_keys


def test_the_configuration_accepts_exactly_the_layouts():
    assert tuple(LAYOUTS) == ("overlap", "sequential")
    for name in LAYOUTS:
        for spelled in (name, name.upper()):
            assert ChunkCacheConfig.from_env({"VLLM_CHUNK_CACHE_LAYOUT": spelled}).layout == name
    for other in ("diagonal", "overlap,sequential", ""):
        with pytest.raises(ChunkCacheConfigError, match="accepted values: overlap, sequential"):
            ChunkCacheConfig.from_env({"VLLM_CHUNK_CACHE_LAYOUT": other})
