"""Defaults that start anywhere: `VLLM_ENABLE_CHUNK_CACHE=1 VLLM_CPU_KVCACHE_SPACE=1 vllm serve` on
the tiny model, no chunk cache setting at all (1 GiB of KV in all, less than the fixed 2 GiB pool
of old): the session's server (`tiny_llama_server`) starts so, says in one log line how big its
pool is, and answers chunked prompts as the HF reference, the second time from the pool."""

from __future__ import annotations

import re
from pathlib import Path

from harness import chunk_cases as cc
from tests.helpers import server_utils

MAX_TOKENS = 6


def test_a_server_with_no_pool_setting_sizes_the_pool_from_its_kv_memory(
    models_dir: Path, tiny_llama_server: str, tiny_llama_server_log: Path
):
    docs = [cc.document(700 + i, 60) for i in range(3)]
    prompts = [cc.chunked(cc.SYS, docs, "Which one first?"), cc.chunked(cc.SYS, docs[::-1], "And last?")]
    client = server_utils.client(tiny_llama_server)
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    before = server_utils.metrics(tiny_llama_server)
    for prompt in prompts:
        choice = server_utils.greedy(client, prompt, MAX_TOKENS)
        ref = cc.reference(model, raw_tok, prompt, MAX_TOKENS)[1]
        cc.assert_matches(choice.token_ids, choice.logprobs.token_logprobs, ref, prompt[:40])
    metrics = server_utils.wait_metrics(tiny_llama_server, lambda m: m.hit_count >= before.hit_count + 3)
    assert (metrics.hit_count - before.hit_count, metrics.miss_count - before.miss_count) == (3, 3)
    # tiny Llama keeps 1 KiB of K/V per token: a quarter of 1 GiB is 262,144 tokens, 512 documents.
    (line,) = [x for x in tiny_llama_server_log.read_text().splitlines() if "Chunk Cache pool:" in x]
    assert re.search(
        r"Chunk Cache pool: 0\.25 GiB \(auto: 0\.25 of 1\.00 GiB of KV memory\), 262144 tokens: "
        r"512 documents of 512 tokens; 0\.75 GiB left for the paged KV cache",
        line,
    ), line
