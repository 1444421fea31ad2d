"""A third tier backend inside a real engine: the test-only memory tier (`tests/helpers/memory_tier/`),
registered by one line and built by the package's factory on the scheduler's and the worker's
side, with nothing of it in the package. A pool far smaller than the documents: evicted entries
are kept by the memory tier and filled back across steps (`Fill.LATER`) instead of computed.
Answers are checked against the independent HF reference."""

from __future__ import annotations

from pathlib import Path

from harness import chunk_cases as cc
from tests.engine.test_chunk_engines import SMALL, check_round
from tests.helpers.engine_runner import run_engine

POOL_PAGES = 32  # 512 tokens; tiny-llama keeps 1 KiB of K/V per token (SMALL)


def test_a_registered_backend_serves_evicted_documents_in_an_engine(models_dir: Path):
    docs = [cc.document(500 + i, 100) for i in range(12)]  # 12 x ~7 pages: 2.6x the pool
    sets = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    prompts = [cc.chunked(cc.SYS, [docs[i] for i in s], f"Question on {s}?") for s in sets]
    shuffled = [cc.chunked(cc.SYS, [docs[i] for i in s[::-1]], f"Again {s}?") for s in sets]
    rounds = [{"prompts": prompts}, {"prompts": shuffled}, {"prompts": prompts, "batch": True}]
    result = run_engine(models_dir / "tiny-llama", rounds, env=SMALL, memory_tier=True)
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    check_round(model, raw_tok, prompts, result["rounds"][0], 8, "cold, evicting into the memory tier")
    check_round(model, raw_tok, shuffled, result["rounds"][1], 8, "reordered, filled from the memory tier")
    check_round(model, raw_tok, prompts, result["rounds"][2], 8, "batched, filled from the memory tier")

    cold, warm, batched = result["states"]
    assert cold["misses"] == 12 and cold["evictions"] > 0 and cold["memory_entries"] > 0
    # Only the last set's documents can still be in the pool: the others come from the memory
    # tier, none of them computed again (a chunk prefill per document computed, SYS included).
    assert warm["misses"] == 12 and warm["chunk_prefills"] == cold["chunk_prefills"]
    assert batched["misses"] == 12 and batched["chunk_prefills"] == cold["chunk_prefills"]
    for state in result["states"]:
        assert state["pinned_entries"] == 0 and state["pending_entries"] == 0
        assert state["used_pages"] == state["entry_pages"] <= POOL_PAGES
