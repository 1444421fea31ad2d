"""The host-memory tier in an engine of its own: a pool far smaller than the documents, and
evicted entries copied back from host memory instead of computed; with one worker and with two
(TP=2: each rank's tier holds its half of the KV heads, copied in the same steps). Answers are
checked against the independent HF reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import chunk_cases as cc
from tests.engine.test_chunk_engines import SMALL, check_round
from tests.engine.test_model_parallel import BIND, TP2, needs_two_cores
from tests.helpers.engine_runner import run_engine

POOL_PAGES = 32  # 512 tokens; tiny-llama keeps 1 KiB of K/V per token (SMALL)
HOST = {**SMALL, "VLLM_CHUNK_CACHE_HOST_GB": str(4 * POOL_PAGES * 16 * 1024 / 2**30)}
# A rank of TP=2 keeps half of a token's K/V: the same pages in half the bytes.
HOST_TP2 = {**BIND, **{name: str(float(gb) / 2) for name, gb in HOST.items()}}
SETUPS = {"TP=1": ({}, HOST), "TP=2": (TP2, HOST_TP2)}


def corpus_rounds(first_doc: int) -> list[dict]:
    """12 documents of ~7 pages (2.6x the pool) in 4 sets: cold, reordered, then batched."""
    docs = [cc.document(first_doc + i, 100) for i in range(12)]
    sets = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    prompts = [cc.chunked(cc.SYS, [docs[i] for i in s], f"Question on {s}?") for s in sets]
    shuffled = [cc.chunked(cc.SYS, [docs[i] for i in s[::-1]], f"Again {s}?") for s in sets]
    return [{"prompts": prompts}, {"prompts": shuffled}, {"prompts": prompts, "batch": True}]


def check_corpus_rounds(models_dir: Path, rounds: list[dict], result: dict, tier: str) -> None:
    """Every answer of `corpus_rounds` equal to the HF reference's."""
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    whats = [f"cold, evicting into {tier}", f"reordered, read back from {tier}", f"batched, from {tier}"]
    for rnd, results, what in zip(rounds, result["rounds"], whats, strict=True):
        check_round(model, raw_tok, rnd["prompts"], results, 8, what)


@pytest.mark.parametrize("setup", ["TP=1", pytest.param("TP=2", marks=needs_two_cores)])
def test_a_corpus_larger_than_the_pool_is_served_from_host_memory(models_dir: Path, setup: str):
    rounds = corpus_rounds(300)
    result = run_engine(models_dir / "tiny-llama", rounds, *SETUPS[setup])
    check_corpus_rounds(models_dir, rounds, result, "host memory")

    cold, warm, batched = result["states"]
    assert cold["misses"] == 12 and cold["evictions"] > 0 and cold["host_entries"] > 0
    assert cold["host_bytes_written"] > 0
    # Only the last set's documents can still be in the pool; the others come from host memory.
    assert warm["misses"] == 12 and warm["host_hits"] >= 9 and warm["host_bytes_read"] > 0
    assert batched["misses"] == 12 and batched["chunk_prefills"] == warm["chunk_prefills"]
    for state in result["states"]:
        assert state["pinned_entries"] == 0 and state["pending_entries"] == 0
        assert state["used_pages"] == state["entry_pages"] <= POOL_PAGES
