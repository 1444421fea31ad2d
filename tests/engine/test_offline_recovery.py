"""The recovery modes asked for per request in the shared offline engine: `last[:K]` cold and warm
against the HF reference in which the last K documents belong to the question's segment, and a
bad mode refused. Through `vllm serve`: tests/server/test_recovery.py."""

from __future__ import annotations

import pytest

from harness import chunk_cases as cc
from tests.server.test_recovery import DOCS, LAST, PROMPT, greedy
from vllm_ascend_chunk.frontend.parser import ChunkPromptError


def test_a_request_asks_for_last_cold_and_warm(tiny_llama_llm, raw_tok, models_dir, scheduled_requests):
    tiny_model = cc.hf_reference.load(models_dir / "tiny-llama")
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
