"""The recovery modes without an engine: the mode's choice (server-wide switch, request
key) and the span rewrite that moves the last documents into the question. Through an engine and
the server: `tests/server/test_recovery.py`."""

from __future__ import annotations

import pytest

from vllm_ascend_chunk.config.recovery_modes import COVER_CEILING, SELECT_RUNS, Recovery, recovery_of
from vllm_ascend_chunk.config.settings import get_config
from vllm_ascend_chunk.core.request_info import ChunkSpans
from vllm_ascend_chunk.frontend import recovery
from vllm_ascend_chunk.frontend.parser import ChunkPromptError


class Params:
    def __init__(self, extra_args=None):
        self.extra_args = extra_args


@pytest.fixture
def server_mode(chunk_env):
    return lambda value: chunk_env(VLLM_CHUNK_CACHE_RECOVERY=value)


def requested(params) -> Recovery:
    return recovery.requested_recovery(params, get_config().recovery)


def test_the_server_mode_applies_unless_the_request_names_one(server_mode):
    server_mode(None)
    assert requested(Params()) == Recovery()
    assert requested(Params({"chunk_cache": False})) == Recovery()
    server_mode("LAST")
    assert requested(None) == Recovery(docs=1)
    assert requested(Params({"chunk_cache_recovery": " None "})) == Recovery()
    server_mode("qattn:0.2")
    assert requested(Params()) == Recovery(fraction=0.2, runs=SELECT_RUNS)
    assert requested(Params({"chunk_cache_recovery": "last"})) == Recovery(docs=1)
    assert requested(Params({"chunk_cache_recovery": "last:2"})) == Recovery(docs=2)
    assert requested(Params({"chunk_cache_recovery": "QATTN:0.15/4"})) == Recovery(fraction=0.15, runs=4)
    assert requested(Params({"chunk_cache_recovery": "qattn:1"})) == Recovery(fraction=1.0, runs=SELECT_RUNS)
    server_mode("cover:0.8")
    assert requested(Params()) == Recovery(fraction=COVER_CEILING, runs=SELECT_RUNS, cover=0.8)
    cover = Recovery(fraction=0.3, runs=SELECT_RUNS, cover=0.9, floor=0.05)
    assert requested(Params({"chunk_cache_recovery": "Cover:0.9/0.3/0.05"})) == cover
    assert requested(Params({"chunk_cache_recovery": "cover:1/0"})).fraction == 0.0  # no ceiling: C_1 or all


def test_mode_names_round_trip():
    for name in (
        "none",
        "last",
        "last:3",
        "qattn:0.2",
        "qattn:0.1/4",
        "cover:0.8",
        "cover:0.8/0.3",
        "cover:0.8/0.3/0.1",
    ):
        assert recovery_of(name).name == name


BAD = [
    "first",
    "",
    1,
    None,
    True,
    ["last"],
    "last:0",
    "last:x",
    "last:",
    "qattn",
    "qattn:",
    "qattn:0",
    "qattn:1.5",
    "qattn:-0.1",
    "qattn:nan",
    "qattn:0.2/0",
    "qattn:0.2/",
    "qattn:0.2/x",
    "qattn:0.2/257",
    "cover",
    "cover:",
    "cover:0",
    "cover:1.1",
    "cover:0.8/1.5",
    "cover:0.8/0.1/0.2",  # floor above the ceiling
    "cover:0.8/0.2/-0.1",
    "cover:0.8/0.2/0.1/4",
    "cover:0.8/",
    "cover:nan",
    "cover:inf",
]


@pytest.mark.parametrize("value", BAD)
def test_a_bad_request_mode_names_the_key_and_the_choices(value):
    with pytest.raises(ChunkPromptError, match=r"'chunk_cache_recovery' must be none, last \(= last:1\)"):
        requested(Params({"chunk_cache_recovery": value}))


def test_the_last_documents_join_the_question():
    spans = ChunkSpans(sys_len=4, chunk_lens=[5, 6, 7], question_len=3)
    assert recovery.apply(spans, 0) == spans
    assert recovery.apply(spans, 1) == ChunkSpans(sys_len=4, chunk_lens=[5, 6], question_len=10)
    assert recovery.apply(spans, 2) == ChunkSpans(sys_len=4, chunk_lens=[5], question_len=16)
    assert recovery.apply(spans, 5) == ChunkSpans(sys_len=4, chunk_lens=[], question_len=21)
    none = ChunkSpans(sys_len=4, chunk_lens=[], question_len=3)
    assert recovery.apply(none, 1) == none


def test_a_cover_question_that_cannot_be_scored_is_served_with_every_document():
    """A one-token question: no scoring pass; every document after the first joins the question
    (full attention of the plain prompt); otherwise the spans stay."""
    cover = recovery_of("cover:0.8")
    spans = ChunkSpans(sys_len=4, chunk_lens=[5, 6, 7], question_len=1)
    assert recovery.joined_docs(cover, spans) == 2 and recovery.joined_docs(recovery_of("last:1"), spans) == 1
    assert recovery.joined_docs(cover, ChunkSpans(sys_len=4, chunk_lens=[5, 6, 7], question_len=2)) == 0
    assert recovery.joined_docs(cover, ChunkSpans(sys_len=4, chunk_lens=[], question_len=1)) == 0
