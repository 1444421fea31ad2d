"""One request opts out of the chunk cache: text that contains `# #` (pasted code, markdown
rules, earlier turns) is tokenized and served as an ordinary prompt. Server: `vllm_xargs:
{"chunk_cache": false}`; offline: `SamplingParams(extra_args={"chunk_cache": False})`. Expected
ids come from the raw `tokenizers` file."""

from __future__ import annotations

import math

import pytest

from harness import chunk_cases as cc
from vllm_ascend_chunk.frontend.parser import ChunkPromptError

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


def test_text_with_delimiters_is_chunked_by_default(raw_tok):
    """The premise: without the opt-out, TEXT is a chunked prompt."""
    assert cc.expected_structure(raw_tok, TEXT).token_ids != raw_tok.encode(TEXT).ids


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


def test_offline_opt_out_per_request(tiny_llama_llm, raw_tok, scheduled_requests):
    from vllm import SamplingParams

    off = SamplingParams(max_tokens=1, temperature=0, extra_args={"chunk_cache": False})
    on = SamplingParams(max_tokens=1, temperature=0)
    outs = tiny_llama_llm.generate([TEXT, TEXT], [off, on], use_tqdm=False)
    assert outs[0].prompt_token_ids == raw_tok.encode(TEXT).ids
    assert outs[1].prompt_token_ids == cc.expected_structure(raw_tok, TEXT).token_ids
    assert scheduled_requests[0].chunk_cache is None and scheduled_requests[1].chunk_cache is not None


def test_offline_chat_opt_out(tiny_llama_llm, raw_tok, models_dir):
    from vllm import SamplingParams

    off = SamplingParams(max_tokens=1, temperature=0, extra_args={"chunk_cache": "false"})
    out = tiny_llama_llm.chat(MESSAGES, off, use_tqdm=False)[0]
    assert (
        out.prompt_token_ids
        == raw_tok.encode(rendered_chat(models_dir, MESSAGES), add_special_tokens=False).ids
    )


def test_offline_opt_out_drops_explicit_spans(tiny_llama_llm, raw_tok, scheduled_requests):
    from vllm import SamplingParams

    exp = cc.expected_structure(raw_tok, TEXT)
    prompt = {
        "prompt_token_ids": exp.token_ids,
        "chunk_spans": {"sys_len": exp.sys_len, "chunk_lens": exp.chunk_lens},
    }
    off = SamplingParams(max_tokens=1, temperature=0, extra_args={"chunk_cache": 0})
    tiny_llama_llm.generate([prompt], off, use_tqdm=False)
    assert scheduled_requests[0].chunk_cache is None


def test_offline_bad_opt_out_value(tiny_llama_llm):
    from vllm import SamplingParams

    with pytest.raises(ChunkPromptError, match="chunk_cache"):
        tiny_llama_llm.generate(
            [TEXT], SamplingParams(max_tokens=1, extra_args={"chunk_cache": "maybe"}), use_tqdm=False
        )


def test_legacy_engine_add_request_opt_out(tiny_llama_llm, raw_tok, scheduled_requests):
    """`LLMEngine.add_request` with a raw text prompt tokenizes inside `process_inputs`."""
    from vllm import SamplingParams

    engine = tiny_llama_llm.llm_engine
    engine.add_request("legacy-off", TEXT, SamplingParams(max_tokens=1, extra_args={"chunk_cache": False}))
    while engine.has_unfinished_requests():
        engine.step()
    assert scheduled_requests[0].prompt_token_ids == raw_tok.encode(TEXT).ids
    assert scheduled_requests[0].chunk_cache is None
