"""The chunk path in engines of their own (one process each): the Qwen2 architecture, a pool
so small that chunks are evicted, a tiny paged KV cache, and the switch off.
Answers are checked against the independent HF reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import chunk_cases as cc
from tests.helpers import engine_runner
from tests.helpers.engine_runner import run_engine


def check_round(
    model, raw_tok, prompts, results, max_tokens, what, layout=cc.DEFAULT_LAYOUT, recovery_docs=0
):
    for prompt, res in zip(prompts, results, strict=True):
        assert "error" not in res, res
        exp, ref = cc.reference(model, raw_tok, prompt, max_tokens, layout, recovery_docs)
        assert res["prompt_ids"] == exp.token_ids
        cc.assert_matches(res["tokens"], res["logprobs"], ref, f"{what}: {prompt[:50]}")


def test_qwen2_cold_warm_reordered_in_the_overlap_layout(models_dir: Path):
    """The seed's layout: every chunk at the positions right after SYS, the question after the longest."""
    docs = [cc.document(40 + i, 60) for i in range(4)] + [cc.UNICODE_DOC]
    first = [
        cc.chunked(cc.SYS, docs[:3], "What is first?"),
        cc.chunked(cc.SYS, [docs[3], docs[4]], "Which is French?"),
        cc.chunked(cc.SYS, [cc.document(60, 700)], "Long one?"),
    ]
    reordered = [
        cc.chunked(cc.SYS, [docs[2], docs[0], docs[1]], "What is first?"),
        cc.chunked(cc.SYS, [docs[4], docs[1], docs[3]], "Mixed?"),
    ]
    rounds = [{"prompts": first}, {"prompts": first}, {"prompts": reordered}]
    result = run_engine(models_dir / "tiny-qwen2", rounds, env={"VLLM_CHUNK_CACHE_LAYOUT": "overlap"})
    model, raw_tok = cc.reference_tools(models_dir, "tiny-qwen2")
    for rnd, res, what in zip(rounds, result["rounds"], ["cold", "warm", "reordered"], strict=True):
        check_round(model, raw_tok, rnd["prompts"], res, 8, what, "overlap")
    cold, warm, reord = result["states"]
    assert (cold["hits"], cold["misses"]) == (0, 6)
    assert (warm["hits"] - cold["hits"], warm["misses"] - cold["misses"]) == (6, 0)
    assert (reord["hits"] - warm["hits"], reord["misses"] - warm["misses"]) == (6, 0)
    assert reord["pinned_entries"] == 0


def sequential_rounds() -> list[dict]:
    """Cold, warm and reordered (one batch) chunked prompts."""
    docs = [cc.document(140 + i, 80 + 30 * i) for i in range(4)] + [cc.UNICODE_DOC]
    first = [
        cc.chunked(cc.SYS, docs[:3], "What is first?"),
        cc.chunked(cc.SYS, [docs[3], docs[4], docs[0]], "Which is French?"),
    ]
    reordered = [
        cc.chunked(cc.SYS, [docs[2], docs[0], docs[1]], "What is first?"),
        cc.chunked(cc.SYS, [docs[4], docs[1], docs[3], docs[2]], "Mixed?"),
    ]
    return [{"prompts": first}, {"prompts": first}, {"prompts": reordered, "batch": True}]


ORDINARY = [
    {
        "prompts": ["An ordinary prompt about ferries.", "One # # delimiter only.", cc.document(9, 300)],
        "batch": True,
    }
]


@pytest.fixture(scope="module")
def llama_engine(models_dir: Path) -> dict:
    """One tiny-llama engine of the default layout, named: the sequential rounds, then the
    ordinary prompts of `test_ordinary_prompts_match_unpatched_behaviour` (with the chunk cache on)."""
    rounds = sequential_rounds() + ORDINARY
    return run_engine(models_dir / "tiny-llama", rounds, env={"VLLM_CHUNK_CACHE_LAYOUT": "sequential"})


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-llama3"])
def test_sequential_layout_cold_warm_reordered(models_dir: Path, name: str, request):
    """Chunks at the positions of the plain concatenation (the default layout, set here by name):
    cached keys re-rotated on load (tiny-llama3: Llama3 rope scaling, so the rescaled frequency
    bands are exercised)."""
    rounds = sequential_rounds()
    if name == "tiny-llama":
        result = request.getfixturevalue("llama_engine")
    else:
        result = run_engine(models_dir / name, rounds, env={"VLLM_CHUNK_CACHE_LAYOUT": "sequential"})
    model, raw_tok = cc.reference_tools(models_dir, name)
    for rnd, res, what in zip(rounds, result["rounds"], ["cold", "warm", "reordered"], strict=False):
        check_round(model, raw_tok, rnd["prompts"], res, 8, f"{name} sequential {what}", "sequential")
    cold, warm, reord = result["states"][:3]
    assert (cold["hits"], cold["misses"]) == (1, 5)  # docs[0] planned by the first request
    assert (warm["hits"] - cold["hits"], warm["misses"] - cold["misses"]) == (6, 0)
    assert (reord["hits"] - warm["hits"], reord["misses"] - warm["misses"]) == (7, 0)


def test_recovery_last_in_the_sequential_layout(models_dir: Path):
    """`VLLM_CHUNK_CACHE_RECOVERY=last`: every request computes its last document with its question
    (never loads or stores it); a request can ask for `none` and gets plain `sequential`."""
    docs = [cc.document(300 + i, 60 + 20 * i) for i in range(4)]
    first = [
        cc.chunked(cc.SYS, docs[:3], "What is first?"),
        cc.chunked(cc.SYS, [docs[3], docs[0]], "And?"),
        cc.chunked(cc.SYS, [docs[1]], "One document only?"),
    ]
    reordered = [cc.chunked(cc.SYS, [docs[2], docs[0], docs[1]], "What is first?")]
    rounds = [
        {"prompts": first},
        {"prompts": first},
        {"prompts": reordered, "batch": True},
        {"prompts": first[:1], "extra_args": {"chunk_cache_recovery": "none"}},
    ]
    env = {"VLLM_CHUNK_CACHE_LAYOUT": "sequential", "VLLM_CHUNK_CACHE_RECOVERY": "last"}
    result = run_engine(models_dir / "tiny-llama", rounds, env=env)
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    for rnd, res, what in zip(rounds[:3], result["rounds"], ["cold", "warm", "reordered"], strict=False):
        check_round(model, raw_tok, rnd["prompts"], res, 8, f"last {what}", "sequential", 1)
    check_round(model, raw_tok, first[:1], result["rounds"][3], 8, "none per request", "sequential")
    counts = [(s["hits"], s["misses"]) for s in result["states"]]
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip([(0, 0), *counts], counts, strict=False)]
    assert steps == [(0, 3), (3, 0), (1, 1), (3, 0)]  # the last documents are never looked up


@pytest.mark.parametrize("layout, budget", [("sequential", 32), ("sequential", 2048), ("overlap", 2048)])
def test_qattn_recomputes_the_question_chosen_tokens_in_place(models_dir: Path, layout: str, budget: int):
    """`VLLM_CHUNK_CACHE_RECOVERY=qattn:0.3/4`: each request scores its documents with its question,
    recomputes the chosen windows in place and its question again; answers equal the HF reference's
    `qattn:0.3/4` in the layout, cold (chunks computed first) and warm, one by one and batched; a
    request that asks for `none` gets plain reuse, one with one document nothing recomputed.
    A 32-token step budget splits the runs and the batched requests' passes into several pieces;
    a large one lets a request's later runs join its first one's forward as rows of their own. In
    `overlap` every document starts at the same position, so a run's positions depend on the
    document each of its tokens is in (a run is cut at each document's start)."""
    docs = [cc.document(700 + i, 50 + 25 * i) for i in range(4)]
    first = [
        cc.chunked(cc.SYS, docs[:3], "What is first in these documents?"),
        cc.chunked(cc.SYS, [docs[3], docs[0], docs[2], docs[1]], "And which one is the longest?"),
    ]
    single = [cc.chunked(cc.SYS, [docs[1]], "One document only, what does it say?")]
    rounds = [
        {"prompts": first},
        {"prompts": first, "batch": True},
        {"prompts": single},
        {"prompts": first[:1], "extra_args": {"chunk_cache_recovery": "none"}},
    ]
    env = {"VLLM_CHUNK_CACHE_RECOVERY": "qattn:0.3/4", "VLLM_CHUNK_CACHE_LAYOUT": layout}
    engine = {"disable_log_stats": False, "max_num_batched_tokens": budget, "max_num_seqs": 4}
    result = run_engine(models_dir / "tiny-llama", rounds, engine, env=env)
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    selected = 0
    for rnd, res, what in zip(rounds[:2], result["rounds"], ["cold", "warm batched"], strict=False):
        for prompt, got in zip(rnd["prompts"], res, strict=True):
            assert "error" not in got, got
            exp, ref, compute = cc.qattn_reference(
                model, raw_tok, prompt, len(got["tokens"]), "qattn:0.3/4", layout
            )
            assert got["prompt_ids"] == exp.token_ids
            assert got["tokens"] == ref.tokens, f"qattn {what}: tokens differ"
            assert abs(got["logprobs"][0] - float(ref.first_logprobs[ref.tokens[0]])) < 2e-3
            selected += len(compute)
    check_round(model, raw_tok, single, result["rounds"][2], 8, "qattn, one document", layout)
    check_round(model, raw_tok, first[:1], result["rounds"][3], 8, "none per request", layout)
    states = result["states"]
    assert states[1]["selections"] == 4 and states[1]["selected_tokens"] == selected
    assert states[3]["selections"] == 4
    assert (states[1]["batched_runs"] > 0) == (budget > 32), states[1]


@pytest.mark.parametrize("layout", ["sequential", "overlap"])
def test_cover_recomputes_what_covers_the_question_s_attention_or_every_document(
    models_dir: Path, layout: str
):
    """`VLLM_CHUNK_CACHE_RECOVERY=cover:0.5/0.3`: each request scores its documents as `qattn`
    does and recomputes the fewest windows that cover half of its question's attention over them
    (C_1's share counts: it is exact); `cover:0.8/0.2`, asked per request, is out of reach of its
    ceiling on both prompts, which are served with every document after C_1 recomputed (the
    guard); `cover:0.3`: C_1 alone covers the second prompt (plain reuse), a few windows the
    first; a one-token question cannot be scored: its documents after C_1 join it (full
    attention of the plain prompt, the reference with `last:2`). Answers equal the HF reference's
    `cover` plan in the layout, with a 32-token step budget that splits the scoring pass and the
    runs into pieces."""
    docs = [cc.document(700 + i, 50 + 25 * i) for i in range(4)]
    prompts = [
        cc.chunked(cc.SYS, docs[:3], "What is first in these documents?"),
        cc.chunked(cc.SYS, [docs[3], docs[0], docs[2], docs[1]], "And which one is the longest?"),
    ]
    modes = ["cover:0.5/0.3", "cover:0.8/0.2", "cover:0.3"]
    rounds = [
        {"prompts": prompts},
        {"prompts": prompts, "batch": True, "extra_args": {"chunk_cache_recovery": modes[1]}},
        {"prompts": prompts, "extra_args": {"chunk_cache_recovery": modes[2]}},
        {"prompts": [cc.chunked(cc.SYS, docs[:3], "?")]},
    ]
    env = {"VLLM_CHUNK_CACHE_RECOVERY": modes[0], "VLLM_CHUNK_CACHE_LAYOUT": layout}
    engine = {"disable_log_stats": False, "max_num_batched_tokens": 32, "max_num_seqs": 4}
    result = run_engine(models_dir / "tiny-llama", rounds, engine, env=env)
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    selected, selections, fallbacks = [], [], []
    check_round(model, raw_tok, rounds[3]["prompts"], result["rounds"][3], 8, "one-token question", layout, 2)
    for mode, res in zip(modes, result["rounds"], strict=False):
        for prompt, got in zip(prompts, res, strict=True):
            assert "error" not in got, got
            exp, ref, compute = cc.qattn_reference(model, raw_tok, prompt, len(got["tokens"]), mode, layout)
            assert got["prompt_ids"] == exp.token_ids
            assert got["tokens"] == ref.tokens, f"{mode}: tokens differ"
            assert abs(got["logprobs"][0] - float(ref.first_logprobs[ref.tokens[0]])) < 2e-3
            selected.append(len(compute))
            fallbacks.append(len(compute) == sum(exp.chunk_lens[1:]))
        selections.append(sum(n > 0 for n in selected))
    assert fallbacks == [False, False, True, True, False, False]
    assert selected[4] > 0 and selected[5] == 0  # C_1 covers the second prompt
    states = result["states"]
    assert [s["selections"] for s in states] == [*selections, selections[-1]]
    assert [s["cover_fallbacks"] for s in states] == [0, 2, 2, 3]
    assert states[-1]["selected_tokens"] == sum(selected)


def test_ngram_speculation_with_chunked_prompts(models_dir: Path):
    """n-gram speculative decoding (drafts from the request's own tokens, no draft layers): chunked
    prompts cold, warm and reordered, answers as the HF reference, with drafts accepted."""
    docs = [cc.document(500 + i, 70) for i in range(3)]
    first = [cc.chunked(cc.SYS, docs, "What is first?"), cc.chunked(cc.SYS, docs[1:], "And?")]
    rounds = [
        {"prompts": first, "max_tokens": 24},
        {"prompts": first, "max_tokens": 24},
        {"prompts": [cc.chunked(cc.SYS, docs[::-1], "Reversed?")], "batch": True, "max_tokens": 64},
    ]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    engine = {"speculative_config": spec, "disable_log_stats": False}
    result = run_engine(models_dir / "tiny-llama", rounds, engine)
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    for rnd, res, what in zip(rounds, result["rounds"], ["cold", "warm", "reordered"], strict=True):
        check_round(model, raw_tok, rnd["prompts"], res, rnd["max_tokens"], f"ngram {what}")
    cold, warm, reordered = result["states"]
    assert (warm["hits"] - cold["hits"], reordered["hits"] - warm["hits"]) == (5, 3)
    assert reordered["accepted_tokens"] > 0, reordered  # drafts were verified and kept


# A 32-page (512-token) pool: every request nearly fills it, so chunks are evicted all the time;
# a 700-token paged KV cache: requests queue for blocks while chunks are pinned.
SMALL = {"VLLM_CHUNK_CACHE_SIZE_GB": str(32 * 16 * 1024 / 2**30)}
SMALL_ENGINE = {"max_model_len": 700, "num_gpu_blocks_override": 6}


def eviction_rounds() -> list[dict]:
    """One by one and batched evicting sets, long generations, aborts, a set larger than the pool,
    then one served still."""
    docs = [cc.document(80 + i, 100) for i in range(9)]
    sets = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [2, 0, 1], [5, 8]]
    evicting = [cc.chunked(cc.SYS, [docs[i] for i in s], f"Question on {s}?") for s in sets]
    preempting = [cc.chunked(cc.SYS, [docs[i], docs[i + 1]], "Tell me more.") for i in (0, 3, 6)]
    aborted = [cc.chunked(cc.SYS, [docs[i], docs[(i + 4) % 9]], "Abort?") for i in range(4)]
    too_big = cc.chunked(cc.SYS, [docs[i] for i in range(5)], "Too many?")
    return [
        {"prompts": evicting},
        {"prompts": evicting, "batch": True},
        {"prompts": preempting, "batch": True, "max_tokens": 160},
        {"prompts": aborted, "abort": True, "max_tokens": 64},
        {"prompts": [too_big]},
        {"prompts": evicting[:1]},
    ]


def preemption_round() -> dict:
    """Short chunked prompts with long generations: several are admitted at once, their decodes
    outgrow a small paged KV cache, and vLLM preempts some; they plan and load again."""
    docs = [cc.document(200 + i, 30) for i in range(6)]
    prompts = [cc.chunked(cc.SYS, [docs[i], docs[(i + 1) % 6]], f"Go on {i}.") for i in range(4)]
    return {"prompts": prompts, "batch": True, "max_tokens": 240}


@pytest.fixture(scope="module")
def small_engine(models_dir: Path) -> dict:
    """One engine of a 6-block KV cache and a 32-page pool: the eviction rounds, then the
    preemption round (its documents fit the pool together)."""
    return run_engine(
        models_dir / "tiny-llama", [*eviction_rounds(), preemption_round()], SMALL_ENGINE, SMALL
    )


def test_eviction_contention_and_aborts_in_a_small_engine(models_dir: Path, small_engine: dict):
    rounds = eviction_rounds()
    evicting, preempting = rounds[0]["prompts"], rounds[2]["prompts"]
    result = small_engine
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    check_round(model, raw_tok, evicting, result["rounds"][0], 8, "one by one")
    check_round(model, raw_tok, evicting, result["rounds"][1], 8, "batched, pool contended")
    check_round(model, raw_tok, preempting, result["rounds"][2], 160, "long generations, 700-token KV cache")
    assert "VLLM_CHUNK_CACHE_SIZE_GB" in result["rounds"][4][0]["error"]
    check_round(model, raw_tok, evicting[:1], result["rounds"][5], 8, "still serving")

    states = result["states"][: len(rounds)]
    assert states[0]["evictions"] > 0
    for state in states:  # nothing leaks: only the LRU holds pages, nothing pinned between rounds
        assert state["pinned_entries"] == 0 and state["pending_entries"] == 0
        assert state["used_pages"] == state["entry_pages"] <= 32
        assert state["users"] == 0 and state["prefills"] == 0


def test_a_request_the_pool_cannot_take_yet_does_not_hold_up_a_cached_one(models_dir: Path):
    """Head-of-line: B needs more pool than is free while A's documents are computed, so B waits;
    C, behind B, has every document cached and is served from the pool at once (before the fix
    it waited behind B, whose documents then evicted C's, and C computed its document again)."""
    docs = [cc.document(80 + i, 100) for i in range(6)]  # ~110 tokens: 7 of the 32 pool pages
    cached = cc.chunked(cc.SYS, [docs[0]], "First question?")  # SYS (3 pages) + 7 pages
    a = cc.chunked(cc.SYS, docs[1:3], "What do A's documents say?")  # 14 new pages: 8 left
    b = cc.chunked(cc.SYS, docs[3:6], "And B's?")  # 21 new pages: only 8 free + 7 evictable
    c = cc.chunked(cc.SYS, [docs[0]], "Second question?")
    rounds = [{"prompts": [cached]}, {"prompts": [a, b, c], "batch": True}]
    result = run_engine(models_dir / "tiny-llama", rounds, {"max_model_len": 700}, SMALL)
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    check_round(model, raw_tok, [a, b, c], result["rounds"][1], 8, "blocked head")
    before, after = result["states"]
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (1, 5)
    assert after["pinned_entries"] == 0 and after["users"] == 0 and after["prefills"] == 0


def test_preempted_chunk_path_requests_give_the_same_answers(models_dir: Path, small_engine: dict):
    """The preemption round, after the eviction rounds in the same small engine."""
    rnd = preemption_round()
    before, state = small_engine["states"][-2:]
    assert state["preemptions"] > before["preemptions"], small_engine["states"]
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    check_round(model, raw_tok, rnd["prompts"], small_engine["rounds"][-1], 240, "preempted")
    assert state["pinned_entries"] == 0 and state["users"] == 0 and state["prefills"] == 0


def test_ordinary_prompts_match_unpatched_behaviour(models_dir: Path, llama_engine: dict):
    """Ordinary prompts: the same tokens with the chunk cache on (after chunked rounds in the same
    engine) and off (= unpatched vLLM)."""
    off = run_engine(models_dir / "tiny-llama", ORDINARY, env={"VLLM_ENABLE_CHUNK_CACHE": "false"})
    assert llama_engine["rounds"][-1:] == off["rounds"]
    assert off["states"][0] == {"preemptions": 0}  # no chunk cache in that engine at all


@pytest.mark.parametrize("name", ["tiny-llama"])
def test_engine_refuses_a_pool_larger_than_its_kv_budget(models_dir: Path, name: str):
    run = subprocess.run(
        [sys.executable, engine_runner.__file__, json.dumps({"model": str(models_dir / name), "rounds": []})],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_CHUNK_CACHE_SIZE_GB": "4", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert run.returncode != 0
    assert "VLLM_CHUNK_CACHE_SIZE_GB=4 leaves no memory for the paged KV cache" in run.stdout + run.stderr
