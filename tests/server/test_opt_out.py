"""One request opts out of the chunk cache: text that contains `# #` (pasted code, markdown
rules, earlier turns) is tokenized and served as an ordinary prompt, through `vllm serve`:
`vllm_xargs: {"chunk_cache": false}`. Expected ids come from the raw `tokenizers` file. Offline
(`SamplingParams(extra_args={"chunk_cache": False})`): tests/engine/test_offline_opt_out.py."""

from __future__ import annotations

import math

import pytest

from harness import chunk_cases as cc

TEXT = "def f():\n    # # TODO: handle x\n    return 1\n# # ---\nWhat does f return?"
MESSAGES = [{"role": "user", "content": TEXT}]
OFF = {"vllm_xargs": {"chunk_cache": False}}


def complete(client, prompt, **extra_body):
    resp = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        extra_body={"return_token_ids": True} | extra_body,
    )
    return resp.choices[0]


def chat(client, messages, **extra_body):
    return client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=2,
        temperature=0,
        extra_body={"return_token_ids": True} | extra_body,
    )


def rendered_chat(models_dir, messages) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models_dir / "tiny-llama")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("value", [False, "false", "0"])
def test_completions_opt_out_tokenizes_the_whole_text(client, raw_tok, value):
    choice = complete(client, TEXT, vllm_xargs={"chunk_cache": value})
    assert choice.prompt_token_ids == raw_tok.encode(TEXT).ids
    assert complete(client, TEXT).prompt_token_ids == cc.expected_structure(raw_tok, TEXT).token_ids


def test_chat_opt_out_tokenizes_the_whole_rendered_text(client, raw_tok, models_dir):
    plain = raw_tok.encode(rendered_chat(models_dir, MESSAGES), add_special_tokens=False).ids
    resp = chat(client, MESSAGES, **OFF)
    assert resp.prompt_token_ids == plain
    assert chat(client, MESSAGES).prompt_token_ids != plain  # chunked without the opt-out


@pytest.mark.parametrize("value", ["maybe", 2, "", 0.5])
def test_a_bad_opt_out_value_is_a_400(client, value):
    import openai

    with pytest.raises(openai.BadRequestError, match="chunk_cache"):
        complete(client, TEXT, vllm_xargs={"chunk_cache": value})
    with pytest.raises(openai.BadRequestError, match="chunk_cache"):
        chat(client, MESSAGES, vllm_xargs={"chunk_cache": value})
    assert complete(client, TEXT, **OFF).token_ids


def test_opted_out_prompt_truncates_as_vllm_does(client, raw_tok):
    """Truncation of an opted-out prompt keeps its last tokens; a chunked prompt it would cut
    into is still refused."""
    import openai

    choice = complete(client, TEXT, truncate_prompt_tokens=8, truncation_side="left", **OFF)
    assert choice.prompt_token_ids == raw_tok.encode(TEXT).ids[-8:]
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens=8"):
        complete(client, TEXT, truncate_prompt_tokens=8, truncation_side="left")


def test_opted_out_prompt_has_prompt_logprobs(client, raw_tok):
    """How to get prompt logprobs of a text that contains delimiters: opt out."""
    resp = client.completions.create(
        model="tiny-llama", prompt=TEXT, max_tokens=1, temperature=0, echo=True, logprobs=1, extra_body=OFF
    )
    logprobs = resp.choices[0].logprobs.token_logprobs
    assert len(logprobs) == len(raw_tok.encode(TEXT).ids) + 1
    assert logprobs[0] is None and all(math.isfinite(lp) for lp in logprobs[1:])
