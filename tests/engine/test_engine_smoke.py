"""A real patched vLLM engine on the tiny model: it starts with the plugin, carries the new
request field, serves a chunked prompt from its pool, and decodes exactly like the independent
HF reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import chunk_cases as cc
from harness import hf_reference
from vllm_ascend_chunk.metrics import chunk_cache_metrics

PROMPTS = [
    "The ferry leaves the harbour every hour, except on Sundays.",
    "A prompt with a single # # delimiter is an ordinary prompt.",
    "日本語 café 😀 unicode prompt",
]


@pytest.mark.parametrize("max_tokens", [12])
def test_greedy_generation_matches_hf_reference(tiny_llama_llm, models_dir: Path, max_tokens: int):
    from vllm import SamplingParams

    model = hf_reference.load(models_dir / "tiny-llama")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    for out in tiny_llama_llm.generate(PROMPTS, params):
        ref = hf_reference.greedy(model, out.prompt_token_ids, max_tokens)
        got = out.outputs[0]
        assert list(got.token_ids) == ref.tokens
        for step, token, want in zip(got.logprobs, got.token_ids, ref.logprobs, strict=True):
            assert abs(step[token].logprob - want) < 2e-3


def test_a_chunked_request_carries_its_spans_misses_then_hits_and_answers_as_the_hf_reference(
    tiny_llama_llm, models_dir: Path, raw_tok
):
    """The chunk cache runs in the engine: the chunked request's documents are computed once (2
    misses), found in the pool the second time (2 hits), and both answers are the HF reference of
    the chunk semantics; the ordinary prompt beside it carries no spans."""
    from vllm import SamplingParams

    scheduler = tiny_llama_llm.llm_engine.engine_core.engine_core.scheduler
    seen = {}
    add = scheduler.add_request
    scheduler.add_request = lambda request: (
        seen.setdefault(request.request_id, request.chunk_cache),
        add(request),
    )[1]
    # Documents no other test sends to the shared engine: their counts start at nothing.
    chunked_prompt = (
        "Answer briefly. # # The smoke test's ferry to Paris leaves at noon. # # "
        "The smoke test's train to Rome leaves at dawn. # # When does the ferry leave?"
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)
    try:
        before = chunk_cache_metrics(tiny_llama_llm)
        outs = tiny_llama_llm.generate([chunked_prompt, PROMPTS[0]], params, use_tqdm=False)
        cold = chunk_cache_metrics(tiny_llama_llm)
        (warm_out,) = tiny_llama_llm.generate([chunked_prompt], params, use_tqdm=False)
        warm = chunk_cache_metrics(tiny_llama_llm)
    finally:
        del scheduler.add_request  # the class's method again
    # The engine's ids are the outputs' with a suffix; besides them, the documents' chunk prefills.
    engine_ids = {key.rsplit("-", 1)[0]: key for key in seen if not key.startswith("chunk-cache-prefill-")}
    chunked, ordinary = (seen[engine_ids[out.request_id]] for out in outs)
    assert ordinary is None
    assert len(chunked.chunk_lens) == len(chunked.chunk_hashes) == 2 and min(chunked.chunk_lens) > 0
    spans = chunked.sys_len + sum(chunked.chunk_lens) + chunked.question_len
    assert spans == len(outs[0].prompt_token_ids) and not chunked.recovers
    assert (cold.miss_count - before.miss_count, cold.hit_count - before.hit_count) == (2, 0)
    assert cold.chunk_prefills - before.chunk_prefills == 2
    assert (warm.hit_count - cold.hit_count, warm.miss_count - cold.miss_count) == (2, 0)
    model = hf_reference.load(models_dir / "tiny-llama")
    cc.assert_output_matches(outs[0], model, raw_tok, chunked_prompt, "cold")
    cc.assert_output_matches(warm_out, model, raw_tok, chunked_prompt, "warm")


def test_invalid_configuration_fails_start_up(models_dir: Path):
    code = (
        f"from vllm import LLM\nLLM({str(models_dir / 'tiny-llama')!r}, dtype='float32', max_model_len=512)\n"
    )
    env = {**os.environ, "VLLM_CHUNK_CACHE_LAYOUT": "diagonal"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert (
        "VLLM_CHUNK_CACHE_LAYOUT='diagonal' is invalid; accepted values: overlap, sequential" in result.stderr
    )
