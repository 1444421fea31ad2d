"""The recovery modes through `vllm serve` (default layout), asked for per request: `last[:K]`
against the HF reference in which the last document belongs to the question's segment
(`chunk_cases.reference(..., recovery_docs=1)`), `qattn` against the HF `qattn:r/m` plan
(`chunk_cases.qattn_reference`). The same through the shared offline engine:
`tests/engine/test_offline_recovery.py`; the mode's choice and span rewrite:
`tests/unit/test_recovery.py`; the server-wide switch in the sequential layout:
`tests/engine/test_chunk_engines.py`."""

from __future__ import annotations

import pytest

from harness import chunk_cases as cc

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
