"""The layouts' position rules against hand-computed positions (`docs/design.md`, Semantics)."""

from vllm_ascend_chunk.config import LAYOUTS as CONFIG_CHOICES
from vllm_ascend_chunk.layouts import LAYOUTS
from vllm_ascend_chunk.metadata import ChunkSpans

SPANS = ChunkSpans(sys_len=2, chunk_lens=[3, 5, 1], question_len=2)


def test_overlap_lowers_what_the_request_computes_by_all_but_the_longest_chunk():
    overlap = LAYOUTS["overlap"]
    # Question index 11 sits at s + max len = 7: lowered by (3 + 5 + 1) - 5 = 4.
    assert overlap.question_shift(SPANS) == 4 and overlap.load_deltas(SPANS) is None
    assert overlap.question_shift(ChunkSpans(sys_len=2, chunk_lens=[], question_len=1)) == 0
    assert not overlap.rotates_loaded_keys


def test_sequential_moves_each_cached_key_by_the_lengths_before_its_chunk():
    sequential = LAYOUTS["sequential"]
    assert sequential.load_deltas(SPANS) == [0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 8]
    assert sequential.question_shift(SPANS) == 0 and sequential.rotates_loaded_keys


def test_the_configuration_accepts_exactly_the_layouts():
    assert CONFIG_CHOICES == tuple(LAYOUTS) == ("overlap", "sequential")
