"""Tensor parallelism (issue 29): the chunk cache in an engine of two CPU workers, each holding the
pool of its half of the KV heads. Answers are checked against the independent HF reference (the
same check as at TP=1), in both layouts; the hit/miss counts are the scheduler's, once per request.

vLLM's CPU backend runs each rank in its own process with one OpenMP thread bound to one core
(`VLLM_CPU_OMP_THREADS_BIND='0|1'`); it refuses TP=2 on fewer allowed cores than ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.engine.test_chunk_engines import check_round
from tests.helpers import chunk_cases as cc
from tests.helpers.engine_runner import run_engine

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="TP=2 on CPU binds one core per rank"
)


@pytest.mark.parametrize("layout", ["sequential", "overlap"])
def test_tp2_cold_warm_reordered_and_joins(models_dir: Path, layout: str):
    docs = [cc.document(700 + i, 60 + 25 * i) for i in range(5)] + [cc.UNICODE_DOC]
    first = [
        cc.chunked(cc.SYS, docs[:3], "What is first?"),
        cc.chunked(cc.SYS, [docs[3], docs[5], docs[0]], "Which is French?"),
    ]
    reordered = [
        cc.chunked(cc.SYS, [docs[2], docs[0], docs[1]], "What is first?"),
        cc.chunked(cc.SYS, [docs[5], docs[1], docs[3], docs[2]], "Mixed?"),
    ]
    late = [cc.chunked(cc.SYS, [docs[4], docs[0]], "Late?"), cc.chunked(cc.SYS, [docs[4]], "Alone?")]
    rounds = [
        {"prompts": first},
        {"prompts": first},
        {"prompts": reordered, "batch": True},
        {"prompts": [cc.document(720, 80)], "late": late, "late_after": 2, "max_tokens": 12},
    ]
    result = run_engine(models_dir / "tiny-llama", rounds, TP2, {**BIND, "VLLM_CHUNK_CACHE_LAYOUT": layout})
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    for rnd, res, what in zip(rounds[:3], result["rounds"], ["cold", "warm", "reordered"], strict=False):
        check_round(model, raw_tok, rnd["prompts"], res, 8, f"TP=2 {layout} {what}", layout)
    check_round(model, raw_tok, late, result["rounds"][3][1:], 12, f"TP=2 {layout} joins", layout)
    counts = [(s["hits"], s["misses"]) for s in result["states"]]
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip([(0, 0), *counts], counts, strict=False)]
    # Round 1: docs[0] is resident when the second prompt comes. Round 4: the late prompts join
    # together, the second one joins the first one's docs[4] prefill in flight (a miss, a join).
    assert steps == [(1, 5), (6, 0), (7, 0), (1, 2)]
    joins = [s["inflight_joins"] for s in result["states"]]
    assert joins[3] - joins[2] == 1, joins
    assert result["states"][-1]["pinned_entries"] == 0
