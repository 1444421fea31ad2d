"""Token-id prompts with explicit chunk structure on a real `vllm serve`: `"prompt": [ids...]` and
`"vllm_xargs": {"chunk_spans": {"sys_len": S, "chunk_lens": [...]}}` (a JSON object, or its JSON
text) is served as the offline `{"prompt_token_ids": ..., "chunk_spans": ...}`: answers as the HF
reference with the chunk mask, the documents cached under the same keys as the text form's; bad
spans are a 400 naming `chunk_spans`; without spans the ids are an ordinary prompt. Expected ids
come from the raw `tokenizers` file (`chunk_cases.expected_structure`)."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from harness import chunk_cases as cc
from tests.helpers import server_utils

MAX_TOKENS = 6
DOCS = [cc.document(1300 + i, 40) for i in range(3)]
QUESTION = "Which ferry leaves first?"
TEXT = cc.chunked(cc.SYS, DOCS, QUESTION)


@pytest.fixture(scope="module")
def tiny_model(models_dir):
    return cc.hf_reference.load(models_dir / "tiny-llama")


def structure(raw_tok, text: str) -> tuple[list[int], dict]:
    """A client's own tokenization of a chunked text: its ids and their `chunk_spans`."""
    exp = cc.expected_structure(raw_tok, text)
    return exp.token_ids, {"sys_len": exp.sys_len, "chunk_lens": exp.chunk_lens}


def complete(client, prompt, max_tokens: int = MAX_TOKENS, **extra_body):
    return server_utils.greedy(client, prompt, max_tokens, **extra_body)


def cache_delta(url: str, parts: int, send, *args, **kwargs) -> tuple[object, int, int]:
    """What `send(*args, **kwargs)` returns, and the (hits, misses) of the chunk cache it caused
    (`parts` of them)."""
    before = server_utils.metrics(url)
    out = send(*args, **kwargs)
    after = server_utils.wait_metrics(
        url, lambda m: m.hit_count + m.miss_count >= before.hit_count + before.miss_count + parts
    )
    return out, after.hit_count - before.hit_count, after.miss_count - before.miss_count


def test_spans_in_vllm_xargs_serve_the_chunked_prompt(client, tiny_llama_server, raw_tok, tiny_model):
    """Cold, the documents are computed; in another order (spans as JSON text), loaded; the text
    form of the first prompt then hits the same entries."""
    reordered = cc.chunked(cc.SYS, DOCS[::-1], QUESTION)
    for text, spans_as, want in [(TEXT, dict, (0, 3)), (reordered, json.dumps, (3, 0))]:
        ids, spans = structure(raw_tok, text)
        xargs = {"chunk_spans": spans_as(spans)}
        choice, hits, misses = cache_delta(tiny_llama_server, 3, complete, client, ids, vllm_xargs=xargs)
        assert choice.prompt_token_ids == ids
        ref = cc.reference(tiny_model, raw_tok, text, MAX_TOKENS)[1]
        cc.assert_matches(choice.token_ids, choice.logprobs.token_logprobs, ref, text[:40])
        assert (hits, misses) == want, text[:40]
    choice, hits, misses = cache_delta(tiny_llama_server, 3, complete, client, TEXT)
    assert (hits, misses) == (3, 0)
    assert choice.prompt_token_ids == structure(raw_tok, TEXT)[0]


def test_a_batch_of_one_token_prompt_takes_spans(client, raw_tok, tiny_model):
    ids, spans = structure(raw_tok, TEXT)
    choice = complete(client, [ids], vllm_xargs={"chunk_spans": spans})
    ref = cc.reference(tiny_model, raw_tok, TEXT, MAX_TOKENS)[1]
    cc.assert_matches(choice.token_ids, choice.logprobs.token_logprobs, ref, "[[ids]]")


def bad_cases(n: int) -> list[tuple[str, object, dict]]:
    """(what, prompt or None for the token ids, vllm_xargs) of requests whose spans are refused;
    `n` is the number of token ids."""

    def spans(value) -> dict:
        return {"chunk_spans": value}

    return [
        ("sys_len a string", None, spans({"sys_len": "3", "chunk_lens": [4]})),
        ("sys_len a float", None, spans({"sys_len": 3.0, "chunk_lens": [4]})),
        ("chunk_lens a number", None, spans({"sys_len": 3, "chunk_lens": 4})),
        ("chunk_lens of strings", None, spans({"sys_len": 3, "chunk_lens": ["4"]})),
        ("negative sys_len", None, spans({"sys_len": -1, "chunk_lens": [4]})),
        ("negative chunk length", None, spans({"sys_len": 3, "chunk_lens": [4, -2]})),
        ("empty chunk", None, spans({"sys_len": 3, "chunk_lens": [0]})),
        ("no chunk_lens", None, spans({"sys_len": 3})),
        ("unknown key", None, spans({"sys_len": 3, "chunk_lens": [4], "question_len": 2})),
        ("an array", None, spans([3, 4])),
        ("a number", None, spans(7)),
        ("not JSON", None, spans("sys_len=3")),
        ("JSON text of bad spans", None, spans(json.dumps({"sys_len": -3, "chunk_lens": [4]}))),
        ("no question left", None, spans({"sys_len": 3, "chunk_lens": [n - 3]})),
        ("more than the prompt", None, spans({"sys_len": n, "chunk_lens": [4]})),
        ("a text prompt", TEXT, spans({"sys_len": 3, "chunk_lens": [4]})),
        ("a batch of two", "batch", spans({"sys_len": 3, "chunk_lens": [4]})),
    ]


@pytest.mark.parametrize("case", range(len(bad_cases(0))), ids=[c[0] for c in bad_cases(0)])
def test_bad_spans_are_a_400_naming_chunk_spans(tiny_llama_server, client, raw_tok, case):
    ids, spans = structure(raw_tok, TEXT)
    what, prompt, xargs = bad_cases(len(ids))[case]
    prompt = [ids, ids] if prompt == "batch" else ids if prompt is None else prompt
    with httpx.Client(base_url=tiny_llama_server, timeout=server_utils.TIMEOUT) as http:
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 2, "vllm_xargs": xargs}
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 400, (what, resp.text)
        assert "chunk_spans" in resp.json()["error"]["message"], (what, resp.text)
        # The same connection serves the next request.
        body["vllm_xargs"] = {"chunk_spans": spans}
        body["prompt"] = ids
        assert http.post("/v1/completions", json=body).status_code == 200


def test_spans_on_chat_are_a_400(client):
    import openai

    for value in [{"sys_len": 3, "chunk_lens": [4]}, json.dumps({"sys_len": 3, "chunk_lens": [4]})]:
        with pytest.raises(openai.BadRequestError, match="chunk_spans"):
            client.chat.completions.create(
                model="tiny-llama",
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=2,
                extra_body={"vllm_xargs": {"chunk_spans": value}},
            )
    assert complete(client, QUESTION, max_tokens=2).token_ids


def prompt_logprobs(client, ids, **extra_body) -> list:
    resp = client.completions.create(
        model="tiny-llama",
        prompt=ids,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body=extra_body,
    )
    return resp.choices[0].logprobs.token_logprobs


def test_token_prompt_without_spans_is_an_ordinary_prompt(client, raw_tok, tiny_model):
    """The same ids without spans: full causal attention (the HF reference without a chunk
    mask), and prompt logprobs, which a chunked prompt refuses, are given."""
    import openai

    ids, spans = structure(raw_tok, TEXT)
    choice = complete(client, ids)
    assert choice.prompt_token_ids == ids
    ref = cc.hf_reference.greedy(tiny_model, ids, MAX_TOKENS)
    cc.assert_matches(choice.token_ids, choice.logprobs.token_logprobs, ref, "no spans")
    logprobs = prompt_logprobs(client, ids)
    assert len(logprobs) == len(ids) + 1 and all(math.isfinite(lp) for lp in logprobs[1:])
    with pytest.raises(openai.BadRequestError, match="not available for a chunked prompt"):
        prompt_logprobs(client, ids, vllm_xargs={"chunk_spans": spans})


def test_opt_out_drops_the_spans(client, raw_tok, tiny_model):
    """`"chunk_cache": false` with spans: an ordinary prompt, as offline (the spans are dropped
    unread, so prompt logprobs are given)."""
    ids, spans = structure(raw_tok, TEXT)
    off = {"vllm_xargs": {"chunk_cache": False, "chunk_spans": spans}}
    choice = complete(client, ids, **off)
    cc.assert_matches(
        choice.token_ids,
        choice.logprobs.token_logprobs,
        cc.hf_reference.greedy(tiny_model, ids, MAX_TOKENS),
        "opted out",
    )
    assert len(prompt_logprobs(client, ids, **off)) == len(ids) + 1
