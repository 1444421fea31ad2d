"""`chunk_spans` in `vllm_xargs` (no engine): how `/v1/completions` and `/v1/chat/completions`
requests (the patched protocol) parse it into `TokenizeParams.chunk_spans`, and how the renderer
hooks give it to the token-id prompt. Served end to end: `tests/server/test_token_prompts.py`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vllm_ascend_chunk.core.request_info import ChunkSpans
from vllm_ascend_chunk.frontend import request_spans, tokenize
from vllm_ascend_chunk.frontend.parser import ChunkPromptError

SPANS = {"sys_len": 2, "chunk_lens": [3, 4]}
IDS = list(range(1, 13))
MODEL = SimpleNamespace(max_model_len=4096)


def completion(prompt, xargs, **fields):
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest(model="m", prompt=prompt, vllm_xargs=xargs, **fields).build_tok_params(MODEL)


@pytest.mark.parametrize("value", [SPANS, json.dumps(SPANS)])
@pytest.mark.parametrize("prompt", [IDS, [IDS]])
def test_object_or_json_text_on_one_token_prompt(value, prompt):
    params = completion(prompt, {"chunk_spans": value, "other": 1})
    assert params.chunk_spans == SPANS and params.chunk_cache is True


def test_no_spans_is_none():
    assert completion(IDS, None).chunk_spans is None
    assert completion(IDS, {"chunk_cache": "true"}).chunk_spans is None


def test_other_xargs_keep_their_scalar_type():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="vllm_xargs"):
        completion(IDS, {"another_extension": {"a": 1}})


@pytest.mark.parametrize(
    "value, passed",
    [("sys_len=2", "sys_len=2"), (7, 7), ("[2, 3]", [2, 3]), ([2, 3], [2, 3]), ("null", "null")],
)
def test_values_the_renderer_refuses_pass_through(value, passed):
    """Shape and lengths are checked by the renderer, against the ids (same messages as offline)."""
    got = completion(IDS, {"chunk_spans": value}).chunk_spans
    assert got == passed
    with pytest.raises(ChunkPromptError, match="'chunk_spans' must be"):
        tokenize.spans_from(got, len(IDS))


@pytest.mark.parametrize(
    "prompt, fields, what",
    [
        ("a text", {}, "a text prompt"),
        (["a text"], {}, "a text prompt"),
        (["one", "two"], {}, "a batch of 2 text prompts"),
        ([IDS, IDS], {}, "a batch of 2 prompts"),
        (None, {"prompt_embeds": b"x"}, "prompt_embeds"),
        (IDS, {"prompt_embeds": b"x"}, "prompt_embeds"),
    ],
)
def test_anything_but_one_token_prompt_is_refused(prompt, fields, what):
    with pytest.raises(ChunkPromptError, match=f"'chunk_spans' in vllm_xargs .* this request has {what}"):
        completion(prompt, {"chunk_spans": SPANS}, **fields)


def test_chat_refuses_spans():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    for value in [SPANS, json.dumps(SPANS), [2, 3]]:
        request = ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "hi"}], vllm_xargs={"chunk_spans": value}
        )
        with pytest.raises(ChunkPromptError, match="chunk_spans.*chat messages"):
            request.build_tok_params(MODEL)


@pytest.mark.parametrize("off", [False, "false", 0])
def test_opt_out_drops_the_spans_unread(off):
    assert completion(IDS, {"chunk_spans": SPANS, "chunk_cache": off}).chunk_spans is None
    assert completion("text", {"chunk_spans": "junk", "chunk_cache": off}).chunk_spans is None


def test_a_bad_opt_out_value_is_refused_first():
    with pytest.raises(ChunkPromptError, match="'chunk_cache' must be"):
        completion(IDS, {"chunk_spans": SPANS, "chunk_cache": "maybe"})


def test_as_xargs_text_touches_only_chunk_spans():
    data = {"prompt": IDS, "vllm_xargs": {"chunk_spans": SPANS, "x": 1}}
    assert request_spans.as_xargs_text(data) == {
        "prompt": IDS,
        "vllm_xargs": {"chunk_spans": json.dumps(SPANS), "x": 1},
    }
    assert data["vllm_xargs"]["chunk_spans"] is SPANS  # the request body is not changed in place
    for untouched in [{"prompt": IDS}, {"vllm_xargs": None}, {"vllm_xargs": {"chunk_spans": "{}"}}, "raw"]:
        assert request_spans.as_xargs_text(untouched) == untouched


@pytest.fixture
def chunking(monkeypatch):
    monkeypatch.setattr(tokenize, "chunking", lambda vllm_config, params: True)


def test_renderer_gives_the_request_spans_to_the_token_prompt(chunking):
    params = completion(IDS, {"chunk_spans": SPANS})
    prompt = {"prompt_token_ids": list(IDS)}
    tokenize.take_spans(prompt, params, None)
    assert prompt["chunk_spans"] == ChunkSpans(sys_len=2, chunk_lens=[3, 4], question_len=3)
    assert tokenize.check_spans(prompt, params, None)["chunk_spans"].question_len == 3
    cut = {"prompt_token_ids": list(IDS)}
    tokenize.take_spans(cut, params, None)
    cut["prompt_token_ids"] = IDS[:-2]  # as `truncate_prompt_tokens` would
    with pytest.raises(ChunkPromptError, match="12 tokens but 10 remain"):
        tokenize.check_spans(cut, params, None)


def test_renderer_refuses_request_spans_on_a_text_prompt(chunking):
    params = completion(IDS, {"chunk_spans": SPANS})
    with pytest.raises(ChunkPromptError, match="'chunk_spans' needs a token-id prompt"):
        tokenize.tokenize_chunked(None, {"prompt": "a # # b # # c"}, params, None)


@pytest.mark.parametrize("spans", [{"sys_len": 2, "chunk_lens": [10]}, {"sys_len": 12, "chunk_lens": [1]}])
def test_no_question_left_names_chunk_spans(chunking, spans):
    params = completion(IDS, {"chunk_spans": spans})
    with pytest.raises(ChunkPromptError, match=r"no tokens.*'chunk_spans' needs sys_len \+ sum"):
        tokenize.take_spans({"prompt_token_ids": list(IDS)}, params, None)


def test_with_kwargs_keeps_the_spans():
    params = completion(IDS, {"chunk_spans": SPANS})
    assert params.with_kwargs(add_special_tokens=False).chunk_spans == SPANS
