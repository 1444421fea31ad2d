"""A real patched vLLM engine on the tiny model: it starts with the plugin, carries the new
request field, and decodes exactly like the independent HF reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import hf_reference

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
