"""The per-request opt-out (`chunk_cache: false`) without an engine: the values accepted and
refused, where it is read from (`vllm_xargs`, `SamplingParams.extra_args`, tokenization kwargs)
and how it reaches the renderer's `TokenizeParams` (patched vLLM). The served prompts are checked
end to end in tests/server/test_opt_out.py."""

from __future__ import annotations

import pytest
from vllm import PoolingParams, SamplingParams
from vllm.renderers.params import TokenizeParams

from harness import chunk_cases as cc
from tests.server.test_opt_out import TEXT
from vllm_ascend_chunk.frontend import opt_out
from vllm_ascend_chunk.frontend.parser import ChunkPromptError

ON = [True, "true", "True", "1", 1, "yes", "on", " TRUE "]
OFF = [False, "false", "False", "0", 0, "no", "off", " Off\n"]
BAD = [None, "", "maybe", 2, -1, 1.0, "f", [], {}, "true false"]


@pytest.mark.parametrize("value", ON)
def test_values_that_keep_the_chunk_cache(value: object) -> None:
    assert opt_out.parse(value) is True


@pytest.mark.parametrize("value", OFF)
def test_values_that_opt_out(value: object) -> None:
    assert opt_out.parse(value) is False


@pytest.mark.parametrize("value", BAD)
def test_other_values_are_refused_with_a_client_error(value: object) -> None:
    with pytest.raises(ChunkPromptError, match="'chunk_cache' must be false") as caught:
        opt_out.parse(value)
    assert repr(value) in str(caught.value)


def test_the_chunk_cache_is_used_unless_the_request_says_otherwise() -> None:
    assert opt_out.from_extra(None) is True
    assert opt_out.from_extra({}) is True
    assert opt_out.from_extra({"chunk_spans": [[0, 3]], "other": False}) is True
    assert opt_out.from_extra({opt_out.KEY: "false"}) is False
    assert opt_out.from_extra({opt_out.KEY: True}) is True
    with pytest.raises(ChunkPromptError):
        opt_out.from_extra({opt_out.KEY: "nope"})
    with pytest.raises(ChunkPromptError):  # present but null: refused, not taken as absent
        opt_out.from_extra({opt_out.KEY: None})


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(extra_args={}), SamplingParams(extra_args={"x": 1}), PoolingParams()],
    ids=["no-extra-args", "empty", "other-key", "pooling"],
)
@pytest.mark.parametrize("kwargs", [None, {"truncate_prompt_tokens": 5}], ids=["none", "kwargs"])
def test_requests_without_the_choice_keep_the_shared_kwargs(params: object, kwargs: dict | None) -> None:
    assert opt_out.tokenization_kwargs(kwargs, params) is kwargs


@pytest.mark.parametrize("value", [False, "0", True])
def test_a_requests_choice_is_added_to_a_copy_of_the_shared_kwargs(value: object) -> None:
    """The offline entry points share one kwargs dict between their prompts: one prompt's choice
    must not reach the others."""
    shared = {"truncate_prompt_tokens": 5}
    params = SamplingParams(extra_args={opt_out.KEY: value, "x": 1})
    got = opt_out.tokenization_kwargs(shared, params)
    assert got == {"truncate_prompt_tokens": 5, opt_out.KEY: opt_out.parse(value)}
    assert shared == {"truncate_prompt_tokens": 5}
    assert opt_out.tokenization_kwargs(None, params) == {opt_out.KEY: opt_out.parse(value)}


def test_the_requests_choice_wins_over_the_calls_kwargs() -> None:
    params = SamplingParams(extra_args={opt_out.KEY: True})
    assert opt_out.tokenization_kwargs({opt_out.KEY: False}, params) == {opt_out.KEY: True}


def test_a_bad_value_in_extra_args_is_refused_before_rendering() -> None:
    with pytest.raises(ChunkPromptError):
        opt_out.tokenization_kwargs(None, SamplingParams(extra_args={opt_out.KEY: "maybe"}))


@pytest.mark.parametrize(
    ("extra_args", "off"),
    [(None, False), ({"x": 1}, False), ({opt_out.KEY: "off"}, True), ({opt_out.KEY: "on"}, False)],
)
def test_the_choice_reaches_the_renderers_tokenize_params(extra_args: dict | None, off: bool) -> None:
    """Offline path: `extra_args` → tokenization kwargs → `TokenizeParams.with_kwargs` (patch
    0016) → `opted_out`."""
    base = TokenizeParams(max_total_tokens=None)
    assert opt_out.opted_out(base) is False
    kwargs = opt_out.tokenization_kwargs(None, SamplingParams(extra_args=extra_args))
    assert opt_out.opted_out(base.with_kwargs(**(kwargs or {}))) is off


def test_tokenize_params_refuse_a_bad_kwarg() -> None:
    with pytest.raises(ChunkPromptError):
        TokenizeParams(max_total_tokens=None).with_kwargs(**{opt_out.KEY: "maybe"})


def test_params_without_the_field_did_not_opt_out() -> None:
    """E.g. `TokenizeParams` built by code that predates the field."""
    assert opt_out.opted_out(object()) is False


def test_text_with_delimiters_is_chunked_by_default(raw_tok):
    """The premise of the opt-out tests (server and offline): without it, TEXT is a chunked prompt."""
    assert cc.expected_structure(raw_tok, TEXT).token_ids != raw_tok.encode(TEXT).ids
