"""Tensor and pipeline parallelism (issue 29): the chunk cache in an engine of two CPU workers.
TP=2: each worker holds the pool of its half of the KV heads. PP=2: each stage holds the pool of
its own layers, and vLLM keeps two batches in flight. The scheduler plans loads and fills once
for all workers. Answers are checked against the independent HF reference (the same check as
with one worker), in both layouts; the hit/miss counts are the scheduler's, once per request.

vLLM's CPU backend runs each rank in its own process with one OpenMP thread bound to one core
(`VLLM_CPU_OMP_THREADS_BIND='0|1'`); it refuses TP=2 on fewer allowed cores than ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.engine.test_chunk_engines import SMALL_ENGINE, check_round
from tests.helpers import chunk_cases as cc
from tests.helpers.engine_runner import run_engine

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="two workers on CPU bind one core each"
)
pytestmark = needs_two_cores


def parallel_rounds() -> tuple[list[dict], list[list[str]]]:
    """Cold, warm, reordered (one batch) and in-flight joins; the prompts each round checks."""
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
        {"prompts": first, "reset_prefix_cache": True},
    ]
    return rounds, [first, first, reordered, late, first]


def check_parallel_rounds(
    models_dir: Path, rounds: list[dict], checked: list[list[str]], result: dict, layout: str, what: str
) -> None:
    """Every round's answers against the independent HF reference."""
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    names = ["cold", "warm", "reordered", "joins", "after a reset"]
    for i, (prompts, name) in enumerate(zip(checked, names, strict=True)):
        outputs = result["rounds"][i][1:] if rounds[i].get("late") else result["rounds"][i]
        max_tokens = rounds[i].get("max_tokens", 8)
        check_round(model, raw_tok, prompts, outputs, max_tokens, f"{what} {name}", layout)


def count_steps(result: dict) -> list[tuple[int, int]]:
    """(hits, misses) counted in each round."""
    counts = [(s["hits"], s["misses"]) for s in result["states"]]
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip([(0, 0), *counts], counts, strict=False)]


@pytest.mark.parametrize("layout", ["sequential", "overlap"])
@pytest.mark.parametrize("parallel", ["TP=2", "PP=2"])
def test_cold_warm_reordered_and_joins(models_dir: Path, parallel: str, layout: str):
    rounds, checked = parallel_rounds()
    engine, env = {"TP=2": TP2, "PP=2": PP2}[parallel], {**BIND, "VLLM_CHUNK_CACHE_LAYOUT": layout}
    result = run_engine(models_dir / "tiny-llama", rounds, engine, env)
    check_parallel_rounds(models_dir, rounds, checked, result, layout, f"{parallel} {layout}")
    # Round 1: docs[0] is resident when the second prompt comes. Round 4: the late prompts join
    # together, the second one joins the first one's docs[4] prefill in flight (a miss, a join).
    # Round 5: the reset dropped the pool: as cold as round 1.
    assert count_steps(result) == [(1, 5), (6, 0), (7, 0), (1, 2), (1, 5)]
    joins = [s["inflight_joins"] for s in result["states"]]
    assert joins[3] - joins[2] == 1, joins
    assert result["states"][-1]["pinned_entries"] == 0


@pytest.mark.parametrize("parallel", ["TP=2", "PP=2"])
def test_preempted_requests_give_the_same_answers(models_dir: Path, parallel: str):
    """Long generations in a 6-block KV cache: vLLM preempts some requests; they plan and load
    again (with PP=2, while another batch is in flight)."""
    docs = [cc.document(200 + i, 30) for i in range(6)]
    prompts = [cc.chunked(cc.SYS, [docs[i], docs[(i + 1) % 6]], f"Go on {i}.") for i in range(4)]
    rounds = [{"prompts": prompts, "batch": True, "max_tokens": 240}]
    engine = {**{"TP=2": TP2, "PP=2": PP2}[parallel], **SMALL_ENGINE}
    result = run_engine(models_dir / "tiny-llama", rounds, engine, BIND)
    (state,) = result["states"]
    assert state["preemptions"] > 0, state
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    check_round(model, raw_tok, prompts, result["rounds"][0], 240, f"{parallel} preempted")
    assert state["pinned_entries"] == 0 and state["users"] == 0 and state["prefills"] == 0
