"""The `last[:K]` recovery mode: the last (K) documents of a request are computed with its question.

Unit tests of the mode's choice and span rewrite; then the shared offline engine (overlap
layout) and server asked for it per request, answers against the HF reference in which the last
document belongs to the question's segment (`chunk_cases.reference(..., recovery_docs=1)`). The
server-wide switch in the sequential layout: `test_chunk_engines.py`."""

from __future__ import annotations

import chunk_cases as cc
import pytest

from vllm_ascend_chunk.config import get_config
from vllm_ascend_chunk.frontend import recovery
from vllm_ascend_chunk.frontend.parser import ChunkPromptError
from vllm_ascend_chunk.metadata import ChunkSpans

LAST = {"chunk_cache_recovery": "last"}
DOCS = [cc.document(500 + i, 50 + 10 * i) for i in range(3)]
PROMPT = cc.chunked(cc.SYS, DOCS, "Which document is last?")


class Params:
    def __init__(self, extra_args=None):
        self.extra_args = extra_args


@pytest.fixture
def server_mode(monkeypatch):
    def set_mode(value: str | None):
        if value is None:
            monkeypatch.delenv("VLLM_CHUNK_CACHE_RECOVERY", raising=False)
        else:
            monkeypatch.setenv("VLLM_CHUNK_CACHE_RECOVERY", value)
        get_config.cache_clear()

    yield set_mode
    get_config.cache_clear()


def test_the_server_mode_applies_unless_the_request_names_one(server_mode):
    server_mode(None)
    assert recovery.requested(Params()) == 0
    assert recovery.requested(Params({"chunk_cache": False})) == 0
    server_mode("LAST")
    assert recovery.requested(None) == 1
    assert recovery.requested(Params({"chunk_cache_recovery": " None "})) == 0
    server_mode("none")
    assert recovery.requested(Params(LAST)) == 1
    assert recovery.requested(Params({"chunk_cache_recovery": "last:2"})) == 2


@pytest.mark.parametrize("value", ["first", "", 1, None, True, ["last"], "last:0", "last:x", "last:"])
def test_a_bad_request_mode_names_the_key_and_the_choices(value):
    with pytest.raises(ChunkPromptError, match=r"'chunk_cache_recovery' must be none, last \(= last:1\)"):
        recovery.requested(Params({"chunk_cache_recovery": value}))


def test_the_last_documents_join_the_question():
    spans = ChunkSpans(sys_len=4, chunk_lens=[5, 6, 7], question_len=3)
    assert recovery.apply(spans, 0) == spans
    assert recovery.apply(spans, 1) == ChunkSpans(sys_len=4, chunk_lens=[5, 6], question_len=10)
    assert recovery.apply(spans, 2) == ChunkSpans(sys_len=4, chunk_lens=[5], question_len=16)
    assert recovery.apply(spans, 5) == ChunkSpans(sys_len=4, chunk_lens=[], question_len=21)
    none = ChunkSpans(sys_len=4, chunk_lens=[], question_len=3)
    assert recovery.apply(none, 1) == none


def greedy(extra_args=None, max_tokens: int = 6):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True, extra_args=extra_args
    )


@pytest.fixture(scope="module")
def tiny_model(models_dir):
    return cc.hf_reference.load(models_dir / "tiny-llama")


def test_a_request_asks_for_last_cold_and_warm(tiny_llama_llm, raw_tok, tiny_model, scheduled_requests):
    other = cc.chunked(cc.SYS, [DOCS[2], DOCS[0]], "And the other order?")
    for _ in range(2):  # cold, then every loaded document warm
        outs = tiny_llama_llm.generate([PROMPT, other], greedy(LAST), use_tqdm=False)
        for out, text in zip(outs, [PROMPT, other], strict=True):
            cc.assert_output(out, tiny_model, raw_tok, text, recovery_docs=1)
    lens = cc.expected_structure(raw_tok, PROMPT).chunk_lens
    info = scheduled_requests[0].chunk_cache
    assert info.chunk_lens == lens[:2] and len(info.chunk_hashes) == 2
    plain = tiny_llama_llm.generate([PROMPT], greedy(), use_tqdm=False)[0]  # the same engine, no recovery
    cc.assert_output(plain, tiny_model, raw_tok, PROMPT)
    assert scheduled_requests[-1].chunk_cache.chunk_lens == lens
    two = tiny_llama_llm.generate([PROMPT], greedy({"chunk_cache_recovery": "last:2"}), use_tqdm=False)[0]
    cc.assert_output(two, tiny_model, raw_tok, PROMPT, recovery_docs=2)
    assert scheduled_requests[-1].chunk_cache.chunk_lens == lens[:1]


def test_a_bad_mode_is_refused_and_the_engine_keeps_serving(tiny_llama_llm):
    for prompt in [PROMPT, "An ordinary prompt."]:
        with pytest.raises(ChunkPromptError, match="chunk_cache_recovery"):
            tiny_llama_llm.generate([prompt], greedy({"chunk_cache_recovery": "all"}), use_tqdm=False)
    assert tiny_llama_llm.generate([PROMPT], greedy(LAST), use_tqdm=False)[0].outputs[0].token_ids


def test_the_server_takes_the_mode_from_vllm_xargs(client, raw_tok, tiny_model):
    import openai

    resp = client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_token_ids": True, "vllm_xargs": LAST},
    )
    choice = resp.choices[0]
    exp, ref = cc.reference(tiny_model, raw_tok, PROMPT, 6, "overlap", 1)
    assert choice.prompt_token_ids == exp.token_ids
    cc.assert_matches(choice.token_ids, choice.logprobs.token_logprobs, ref, "server, last")
    bad = {
        "model": "tiny-llama",
        "max_tokens": 2,
        "extra_body": {"vllm_xargs": {"chunk_cache_recovery": "x"}},
    }
    with pytest.raises(openai.BadRequestError, match="chunk_cache_recovery"):
        client.completions.create(prompt=PROMPT, **bad)
    with pytest.raises(openai.BadRequestError, match="chunk_cache_recovery"):
        client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **bad)
    again = client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=2, extra_body={"return_token_ids": True}
    )
    assert again.choices[0].token_ids
