"""Runs a patched vLLM engine in its own process and prints what happened as JSON.

    python tests/helpers/engine_runner.py SPEC_JSON      (`run_engine` starts it and reads RESULT)

SPEC: {"model": dir, "dtype": "float32" (default) | "bfloat16", "engine": {LLM kwargs},
       "rounds": [{"prompts": [...], "max_tokens": n, "batch": bool (one generate call),
                   "abort": bool (abort them mid-way),
                   "late": [...], "late_after": k (the prompts first; after k engine steps the
                   `late` ones join the running batch),
                   "extra_args": {...} (`SamplingParams.extra_args` of the round),
                   "reset_prefix_cache": bool (first reset the prefix cache, which drops the
                   chunk pool and keeps other KV connectors' stores)}, ...],
       "memory_tier": bool (the test-only memory tier registered as a third backend)}.
A prompt is text or a token-id prompt {"prompt_token_ids": [...], "chunk_spans": {...}}.
Output line `RESULT {...}`: per round the prompt ids, generated ids and logprobs (or the error
text) of every prompt, the chunk cache state after each round, and the engine's execution mode
(scheduler class, CUDA graph mode, attention backend) and start-up time.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so its state is visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def chunk_state(llm) -> dict | None:
    connector = getattr(llm.llm_engine.engine_core.engine_core.scheduler, "chunk_connector", None)
    if connector is None:
        return None
    coordinator = connector.coordinator
    manager = coordinator.manager
    return {
        **connector.stats_payload(),
        "used_pages": manager.used_pages,
        "entry_pages": sum(len(e.pages) for e in manager.entries.values()),
        "pending_entries": sum(not e.resident for e in manager.entries.values()),
        "users": len(coordinator.users),
        "prefills": len(coordinator.prefills),
    }


def run_round(llm, prompts, params) -> list[dict]:
    results = []
    for prompt in prompts:  # one by one so that a refused prompt does not hide the others
        try:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
        except ValueError as err:
            results.append({"error": str(err)})
            continue
        gen = out.outputs[0]
        results.append(
            {
                "prompt_ids": out.prompt_token_ids,
                "tokens": list(gen.token_ids),
                "logprobs": [step[t].logprob for step, t in zip(gen.logprobs, gen.token_ids, strict=True)],
                "cached": out.num_cached_tokens,
            }
        )
    return results


def run_batch(llm, prompts, params) -> list[dict]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        {
            "prompt_ids": o.prompt_token_ids,
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [
                s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ],
        }
        for o in outs
    ]


def run_staggered(llm, prompts, late, late_after: int, params) -> list[dict]:
    """`prompts` start; after `late_after` engine steps `late` join the running batch (their
    chunk prefills then share steps with decodes). Results in the order prompts + late."""
    engine = llm.llm_engine
    ids = [f"early-{i}" for i in range(len(prompts))] + [f"late-{i}" for i in range(len(late))]
    outs = {}

    def step():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out

    for rid, prompt in zip(ids, prompts, strict=False):
        engine.add_request(rid, prompt, params)
    for _ in range(late_after):
        step()
    for rid, prompt in zip(ids[len(prompts) :], late, strict=True):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        step()
    return [
        {
            "prompt_ids": outs[r].prompt_token_ids,
            "tokens": list(outs[r].outputs[0].token_ids),
            "logprobs": [
                s[t].logprob
                for s, t in zip(outs[r].outputs[0].logprobs, outs[r].outputs[0].token_ids, strict=True)
            ],
        }
        for r in ids
    ]


def spec_decode_counts(llm) -> dict:
    """Draft tokens proposed and accepted so far (speculative decoding with stats logging on)."""
    names = {
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    if llm.llm_engine.vllm_config.speculative_config is None:
        return {}
    return {names[m.name]: m.value for m in llm.get_metrics() if m.name in names}


def engine_info(llm) -> dict:
    config = llm.llm_engine.vllm_config
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    info = {
        "scheduler": type(scheduler).__name__,
        "dtype": str(config.model_config.dtype),
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "enforce_eager": bool(config.model_config.enforce_eager),
    }
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        info["attention_backends"] = sorted(
            {g.backend.get_name() for groups in runner.attn_groups for g in groups}
        )
    except AttributeError:
        pass
    return info


def abort_midway(llm, prompts, params) -> None:
    """Add requests, step the engine a little, then abort them all."""
    engine = llm.llm_engine
    ids = [f"abort-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    for _ in range(2):
        engine.step()
    engine.abort_request(ids)
    scheduler = engine.engine_core.engine_core.scheduler
    while scheduler.has_unfinished_requests():  # chunk prefills of aborted requests drain
        engine.step()


def reset_prefix_cache(llm) -> None:
    """`LLM.reset_prefix_cache`, retried while blocks are still held (a KV connector's
    asynchronous saves delay their freeing; a one-token request steps the engine)."""
    from vllm import SamplingParams

    for _ in range(50):
        if llm.reset_prefix_cache():
            return
        llm.generate(["."], SamplingParams(max_tokens=1), use_tqdm=False)
    raise RuntimeError("the prefix cache could not be reset")


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not spec.get("memory_tier"):
        run(spec)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.helpers.memory_tier import registered

    with registered():  # the engine core and its one worker run here: both halves see it
        run(spec)


def run(spec: dict) -> None:
    """Builds the engine of `spec`, runs its rounds and prints the RESULT line."""
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(spec["model"], dtype=spec.get("dtype", "float32"), seed=0, **spec.get("engine", {}))
    start_s = time.monotonic() - started
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preemptions = []
    preempt = scheduler._preempt_request
    scheduler._preempt_request = lambda *a, **k: (preemptions.append(1), preempt(*a, **k))[1]
    result = {"rounds": [], "states": [], "engine": {**engine_info(llm), "start_s": round(start_s, 1)}}
    for rnd in spec["rounds"]:
        params = SamplingParams(
            max_tokens=rnd.get("max_tokens", 8),
            temperature=0.0,
            logprobs=1,
            ignore_eos=True,
            extra_args=rnd.get("extra_args"),
        )
        if rnd.get("reset_prefix_cache"):
            reset_prefix_cache(llm)
        if rnd.get("abort"):
            abort_midway(llm, rnd["prompts"], params)
            result["rounds"].append([])
        elif rnd.get("late"):
            result["rounds"].append(
                run_staggered(llm, rnd["prompts"], rnd["late"], rnd.get("late_after", 4), params)
            )
        elif rnd.get("batch"):
            result["rounds"].append(run_batch(llm, rnd["prompts"], params))
        else:
            result["rounds"].append(run_round(llm, rnd["prompts"], params))
        result["states"].append(
            {**(chunk_state(llm) or {}), "preemptions": len(preemptions), **spec_decode_counts(llm)}
        )
    print("RESULT " + json.dumps(result), flush=True)


def run_engine(
    model_dir: Path,
    rounds: list[dict],
    engine: dict | None = None,
    env: dict | None = None,
    dtype: str = "float32",
    memory_tier: bool = False,
) -> dict:
    """Runs `rounds` on an engine of `model_dir` in a child process (this file); its RESULT."""
    spec = {
        "model": str(model_dir),
        "dtype": dtype,
        "engine": {"max_model_len": 4096, **(engine or {})},
        "rounds": rounds,
        "memory_tier": memory_tier,
    }
    run = subprocess.run(
        [sys.executable, __file__, json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=900,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    return json.loads(run.stdout.split("RESULT ", 1)[1].split("\n", 1)[0])  # workers may print after it


if __name__ == "__main__":
    main()
