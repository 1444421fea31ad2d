"""Data parallelism (issue 29): `vllm serve --data-parallel-size 2`, two engine cores each with
its own pool, one API server per engine (vLLM's default). Answers are checked against the HF
reference; the chunk cache counters are counted once per document occurrence, whichever API
server received an engine's statistics (each frontend adds the increments it is sent).

vLLM's CPU backend binds one core per engine (`VLLM_CPU_OMP_THREADS_BIND='0|1'`)."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import chunk_cases as cc
from harness.serve_util import scrape
from tests.helpers import server_utils

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="DP=2 on CPU binds one core per engine"
)
MAX_TOKENS = 6


def test_dp2_answers_and_counters_once_per_occurrence(models_dir: Path, tmp_path: Path):
    docs = [cc.document(950 + i, 50) for i in range(4)]
    prompts = [cc.chunked(cc.SYS, [docs[i % 4], docs[(i + 1) % 4]], f"Question {i}?") for i in range(8)]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1", **server_utils.OWN_PROCESS}
    args = ["--data-parallel-size", "2"]
    with server_utils.vllm_server(models_dir / "tiny-llama", tmp_path / "serve.log", env, args) as url:
        client = server_utils.client(url)
        with ThreadPoolExecutor(4) as pool:
            choices = list(pool.map(lambda p: server_utils.greedy(client, p, MAX_TOKENS), prompts))
        m = server_utils.wait_metrics(url, lambda m: m.hit_count + m.miss_count >= 2 * len(prompts), 30)
        text = scrape(url)
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    for prompt, choice in zip(prompts, choices, strict=True):
        exp, ref = cc.reference(model, raw_tok, prompt, MAX_TOKENS)
        assert choice.prompt_token_ids == exp.token_ids
        cc.assert_matches(choice.token_ids, choice.logprobs.token_logprobs, ref, f"DP=2: {prompt[-12:]}")
    assert m.hit_count + m.miss_count == 2 * len(prompts)  # 16 occurrences, each counted once
    # Each document computed once per engine at most. A request that finds its document's prefill
    # already started on its engine joins it: a miss, but no second computation.
    assert len(docs) <= m.miss_count - m.inflight_joins <= 2 * len(docs), m
    engines = set(re.findall(r'^vllm:chunk_cache_misses_total\{engine="(\d)"', text, re.M))
    assert engines == {"0", "1"}, text
    assert m.pinned_entries == 0
