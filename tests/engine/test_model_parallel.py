"""Tensor and pipeline parallelism (issue 29): the chunk cache in an engine of two CPU workers.
TP=2: each worker holds the pool of its half of the KV heads. PP=2: each stage holds the pool of
its own layers, and vLLM keeps two batches in flight. The scheduler plans loads and fills once
for all workers. Answers are checked against the independent HF reference (the same check as
with one worker), in both layouts; the hit/miss counts are the scheduler's, once per request.

vLLM's CPU backend runs each rank in its own process with one OpenMP thread bound to one core
(`VLLM_CPU_OMP_THREADS_BIND='0|1'`); it refuses TP=2 on fewer allowed cores than ranks.

One engine per parallel layout and chunk layout (four in all): a 10-block paged KV cache, room
for every round, which the preemption round (in the `sequential` engines, after the rounds)
outgrows.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import chunk_cases as cc
from tests.engine.test_chunk_engines import check_round, preemption_round
from tests.helpers.engine_runner import run_engine

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="two workers on CPU bind one core each"
)
pytestmark = needs_two_cores


# 10 blocks of 128 tokens: the rounds' largest batch takes 7 blocks, the preemption round's 4
# requests outgrow them (3 blocks each by the end of their 240 tokens).
ENGINE = {"max_model_len": 700, "num_gpu_blocks_override": 10}
PARALLEL = {"TP=2": TP2, "PP=2": PP2}


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


def count_steps(states: list[dict]) -> list[tuple[int, int]]:
    """(hits, misses) counted in each round."""
    counts = [(s["hits"], s["misses"]) for s in states]
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip([(0, 0), *counts], counts, strict=False)]


@pytest.fixture(scope="module")
def engine_run(models_dir: Path):
    """`engine_run(parallel, layout)`: the result of that engine's rounds (then, in `sequential`,
    the preemption round), run once for the tests that read it."""
    results: dict[tuple[str, str], dict] = {}

    def run(parallel: str, layout: str) -> dict:
        if (parallel, layout) not in results:
            rounds = parallel_rounds()[0] + ([preemption_round()] if layout == "sequential" else [])
            env = {**BIND, "VLLM_CHUNK_CACHE_LAYOUT": layout}
            engine = {**PARALLEL[parallel], **ENGINE}
            results[parallel, layout] = run_engine(models_dir / "tiny-llama", rounds, engine, env)
        return results[parallel, layout]

    return run


@pytest.mark.parametrize("layout", ["sequential", "overlap"])
@pytest.mark.parametrize("parallel", ["TP=2", "PP=2"])
def test_cold_warm_reordered_and_joins(models_dir: Path, engine_run, parallel: str, layout: str):
    rounds, checked = parallel_rounds()
    result = engine_run(parallel, layout)
    check_parallel_rounds(models_dir, rounds, checked, result, layout, f"{parallel} {layout}")
    states = result["states"][: len(rounds)]
    # Round 1: docs[0] is resident when the second prompt comes. Round 4: the late prompts join
    # together, the second one joins the first one's docs[4] prefill in flight (a miss, a join).
    # Round 5: the reset dropped the pool: as cold as round 1.
    assert count_steps(states) == [(1, 5), (6, 0), (7, 0), (1, 2), (1, 5)]
    joins = [s["inflight_joins"] for s in states]
    assert joins[3] - joins[2] == 1, joins
    assert states[-1]["pinned_entries"] == 0
    assert states[-1]["preemptions"] == 0, "the rounds outgrew the KV cache"


@pytest.mark.parametrize("parallel", ["TP=2", "PP=2"])
def test_preempted_requests_give_the_same_answers(models_dir: Path, engine_run, parallel: str):
    """The preemption round (with PP=2, while another batch is in flight), after the rounds of the
    same `sequential` engine."""
    rnd = preemption_round()
    result = engine_run(parallel, "sequential")
    before, state = result["states"][-2:]
    assert state["preemptions"] > before["preemptions"], state
    model, raw_tok = cc.reference_tools(models_dir, "tiny-llama")
    check_round(model, raw_tok, rnd["prompts"], result["rounds"][-1], 240, f"{parallel} preempted")
    assert state["pinned_entries"] == 0 and state["users"] == 0 and state["prefills"] == 0
