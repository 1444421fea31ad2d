"""The recovery modes without an engine: the mode's choice (server-wide switch, request
key) and the span rewrite that moves the last documents into the question. Through an engine and
the server: `tests/server/test_recovery.py`."""

from __future__ import annotations

import pytest

from vllm_ascend_chunk.config import SELECT_RUNS, Recovery, recovery_of
from vllm_ascend_chunk.frontend import recovery
from vllm_ascend_chunk.frontend.parser import ChunkPromptError
from vllm_ascend_chunk.metadata import ChunkSpans


class Params:
    def __init__(self, extra_args=None):
        self.extra_args = extra_args


@pytest.fixture
def server_mode(chunk_env):
    return lambda value: chunk_env(VLLM_CHUNK_CACHE_RECOVERY=value)


def requested(params) -> Recovery:
    return recovery.requested_recovery(params)


def test_the_server_mode_applies_unless_the_request_names_one(server_mode):
    server_mode(None)
    assert requested(Params()) == Recovery()
    assert requested(Params({"chunk_cache": False})) == Recovery()
    server_mode("LAST")
    assert requested(None) == Recovery(docs=1)
    assert requested(Params({"chunk_cache_recovery": " None "})) == Recovery()
    server_mode("qattn:0.2")
    assert requested(Params()) == Recovery(select=0.2, runs=SELECT_RUNS)
    assert requested(Params({"chunk_cache_recovery": "last"})) == Recovery(docs=1)
    assert requested(Params({"chunk_cache_recovery": "last:2"})) == Recovery(docs=2)
    assert requested(Params({"chunk_cache_recovery": "QATTN:0.15/4"})) == Recovery(select=0.15, runs=4)
    assert requested(Params({"chunk_cache_recovery": "qattn:1"})) == Recovery(select=1.0, runs=SELECT_RUNS)


def test_mode_names_round_trip():
    for name in ("none", "last", "last:3", "qattn:0.2", "qattn:0.1/4"):
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
