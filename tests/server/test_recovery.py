"""The recovery modes through the shared offline engine (default layout) and server, asked for per
request: `last[:K]` against the HF reference in which the last document belongs to the
question's segment (`chunk_cases.reference(..., recovery_docs=1)`), `qattn` against the HF
`qattn:r/m` plan (`chunk_cases.qattn_reference`). The mode's choice and span
rewrite: `tests/unit/test_recovery.py`; the server-wide switch in the sequential layout:
`tests/engine/test_chunk_engines.py`."""

from __future__ import annotations

import pytest

from harness import chunk_cases as cc
from vllm_ascend_chunk.frontend.parser import ChunkPromptError

LAST = {"chunk_cache_recovery": "last"}
DOCS = [cc.document(500 + i, 50 + 10 * i) for i in range(3)]
PROMPT = cc.chunked(cc.SYS, DOCS, "Which document is last?")


def greedy(extra_args=None, max_tokens: int = 6):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True, extra_args=extra_args
    )


def complete(client, xargs: dict, stream: bool = False) -> tuple[list[int], list[int], list[float]]:
    """A greedy 6-token completion of PROMPT through the server: prompt ids, token ids, logprobs."""
    resp = client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=1,
        stream=stream,
        extra_body={"ignore_eos": True, "return_token_ids": True, "vllm_xargs": xargs},
    )
    choices = [c.choices[0] for c in resp] if stream else [resp.choices[0]]
    tokens = [t for c in choices for t in c.token_ids or []]
    return choices[0].prompt_token_ids, tokens, [lp for c in choices for lp in c.logprobs.token_logprobs]


@pytest.fixture(scope="module")
def tiny_model(models_dir):
    return cc.hf_reference.load(models_dir / "tiny-llama")


def test_a_request_asks_for_last_cold_and_warm(tiny_llama_llm, raw_tok, tiny_model, scheduled_requests):
    other = cc.chunked(cc.SYS, [DOCS[2], DOCS[0]], "And the other order?")
    for _ in range(2):  # cold, then every loaded document warm
        outs = tiny_llama_llm.generate([PROMPT, other], greedy(LAST), use_tqdm=False)
        for out, text in zip(outs, [PROMPT, other], strict=True):
            cc.assert_output_matches(out, tiny_model, raw_tok, text, f"last:1: {text[:40]}", 1)
    lens = cc.expected_structure(raw_tok, PROMPT).chunk_lens
    info = scheduled_requests[0].chunk_cache
    assert info.chunk_lens == lens[:2] and len(info.chunk_hashes) == 2
    plain = tiny_llama_llm.generate([PROMPT], greedy(), use_tqdm=False)[0]  # the same engine, no recovery
    cc.assert_output_matches(plain, tiny_model, raw_tok, PROMPT, f"last:0: {PROMPT[:40]}", 0)
    assert scheduled_requests[-1].chunk_cache.chunk_lens == lens
    two = tiny_llama_llm.generate([PROMPT], greedy({"chunk_cache_recovery": "last:2"}), use_tqdm=False)[0]
    cc.assert_output_matches(two, tiny_model, raw_tok, PROMPT, f"last:2: {PROMPT[:40]}", 2)
    assert scheduled_requests[-1].chunk_cache.chunk_lens == lens[:1]


def test_a_bad_mode_is_refused_and_the_engine_keeps_serving(tiny_llama_llm):
    for prompt in [PROMPT, "An ordinary prompt."]:
        with pytest.raises(ChunkPromptError, match="chunk_cache_recovery"):
            tiny_llama_llm.generate([prompt], greedy({"chunk_cache_recovery": "all"}), use_tqdm=False)
    assert tiny_llama_llm.generate([PROMPT], greedy(LAST), use_tqdm=False)[0].outputs[0].token_ids


def test_the_server_takes_the_mode_from_vllm_xargs(client, raw_tok, tiny_model):
    import openai

    prompt_ids, tokens, logprobs = complete(client, LAST)
    exp, ref = cc.reference(tiny_model, raw_tok, PROMPT, 6, cc.DEFAULT_LAYOUT, 1)
    assert prompt_ids == exp.token_ids
    cc.assert_matches(tokens, logprobs, ref, "server, last")
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


@pytest.mark.parametrize("mode", ["qattn:0.3/4", "cover:0.5/0.3", "cover:0.9/0.1"])
def test_the_server_serves_qattn_per_request(client, raw_tok, tiny_model, mode):
    """`qattn`, and `cover` with windows or (0.9 out of reach of 0.1) every document recomputed."""
    exp, ref, compute = cc.qattn_reference(tiny_model, raw_tok, PROMPT, 6, mode)
    assert compute
    for stream in (False, True):
        prompt_ids, tokens, logprobs = complete(client, {"chunk_cache_recovery": mode}, stream)
        assert prompt_ids == exp.token_ids
        assert tokens == ref.tokens, f"qattn through the server (stream={stream})"
        assert abs(logprobs[0] - float(ref.first_logprobs[ref.tokens[0]])) < 2e-3


def test_the_server_refuses_a_malformed_cover_naming_the_grammar(client):
    import openai

    for bad in ("cover:0", "cover:0.8/0.1/0.2", "cover:x"):
        xargs = {"vllm_xargs": {"chunk_cache_recovery": bad}}
        with pytest.raises(openai.BadRequestError, match=r"cover:TAU\[/RMAX\[/RMIN\]\]") as err:
            client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2, extra_body=xargs)
        assert err.value.status_code == 400
