"""One request opts out of the chunk cache in the shared offline engine
(`SamplingParams(extra_args={"chunk_cache": False})`, `LLM.chat`, `LLMEngine.add_request`):
TEXT, which holds `# #`, is tokenized whole. Through `vllm serve`: tests/server/test_opt_out.py."""

from __future__ import annotations

import pytest

from harness import chunk_cases as cc
from tests.server.test_opt_out import MESSAGES, TEXT, rendered_chat
from vllm_ascend_chunk.frontend.parser import ChunkPromptError


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
