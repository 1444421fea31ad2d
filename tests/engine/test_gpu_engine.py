"""The chunk path on a CUDA GPU in the mode deployments run: bfloat16, vLLM's defaults (torch.compile,
CUDA graphs FULL_AND_PIECEWISE, async scheduling), checked against the independent HF reference.

Skipped without CUDA (marker `cuda`). `CHUNK_CACHE_GPU_TESTS_ON_CPU=1` runs the same cases on the
CPU engine in float32, to check the plumbing where no GPU is at hand (the CPU platform turns
graphs and async scheduling off, so that says nothing about them).

Tolerance, derived in each engine rather than fixed: the first round sends ordinary prompts (no
chunk path at all) of ~130 to ~440 tokens, as long as the chunked prompts, and the largest
|logprob(vLLM) - logprob(HF float32)| over their greedy steps is the engine's own numerical noise
`delta` (bf16 weights and activations, fused kernels). Chunked prompts must then match the
reference to `tol = max(4 * delta, 2e-3)`: a loaded chunk is a copy of K/V the engine computed
itself, so the chunk path may add no error of its own. Tokens must be equal, except that after a
step where the reference's top-1/top-2 log-probability gap is below `2 * tol` (a near-tie that
bf16 noise may flip) the rest of that answer is not compared. `delta` itself must stay below
DELTA_CAP, a check that the engine computes the model at all: the tiny models' logits are large
(greedy decoding without near-ties), so their bf16 noise is too; the first GPU run (an H200,
`results/gpu_tests/gpu_tests_h200.json`) measured 0.03 to 0.27 on ~130-token prompts, and a 4 x delta
of 0.13 was too tight for ~400-token chunked prompts, hence prompts of both lengths now.

`qattn` requests (per request, `chunk_cache_recovery`) are checked against the HF plan of `qattn`
in the same way, and the engine must have scored them (a scoring pass replayed from a full CUDA
graph would be served unscored).

The engines are sized by `kv_cache_memory_bytes` (1 GiB of paged KV cache each) and a small
`gpu_memory_utilization`, not by profiling the free memory, so that several run at once on one GPU
(`pytest -n 5`, as `tools/gpu/session.sh` runs them): vLLM's memory profiling asserts that no
other process frees memory while it measures. The numbers go to `$CHUNK_CACHE_GPU_REPORT` (JSON)
when it is set. `CHUNK_CACHE_GPU_ATTENTION_BACKEND` (e.g. `TRITON_ATTN`) overrides vLLM's choice of
attention backend (FlashAttention 3 on Hopper in bf16).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest
import torch

from harness import chunk_cases as cc
from harness import hf_reference
from tests.helpers.engine_runner import run_engine

ON_CPU = os.environ.get("CHUNK_CACHE_GPU_TESTS_ON_CPU") == "1"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="needs a CUDA GPU"),
]
DTYPE = "float32" if ON_CPU else "bfloat16"
# Small engines: a 4096-token context, 1 GiB of paged KV cache (the pool is carved out of it), so
# that five fit on one GPU at once.
GPU_ENGINE = {"max_model_len": 4096, "gpu_memory_utilization": 0.12, "kv_cache_memory_bytes": 2**30}
ENGINE = {"max_model_len": 4096} if ON_CPU else GPU_ENGINE
if backend := os.environ.get("CHUNK_CACHE_GPU_ATTENTION_BACKEND"):  # e.g. TRITON_ATTN
    ENGINE["attention_config"] = {"backend": backend}
ENV = {"VLLM_CHUNK_CACHE_SIZE_GB": "0.25"}
REPORT = os.environ.get("CHUNK_CACHE_GPU_REPORT")
QATTN = "qattn:0.3/4"
DELTA_CAP = 0.5
"""The most bf16 noise an engine may show on ordinary prompts (nats; see above)."""


def ordinary_prompts(seed: int) -> list[str]:
    """Prompts without documents of ~130, ~290 and ~440 tokens: the engine's noise over the
    lengths of the chunked prompts."""
    return [cc.document(seed + i, words) for i, words in enumerate((120, 260, 400))]


def record(name: str, data: dict) -> None:
    """`data` under `name` in the report (a lock: the tests run in parallel processes)."""
    if not REPORT:
        return
    with open(REPORT, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        report = json.loads(f.read() or "{}")
        report[name] = data
        f.seek(0)
        f.truncate()
        f.write(json.dumps(report, indent=1) + "\n")


def compare(res: dict, ref: hf_reference.Reference, tol: float, what: str) -> dict:
    """Tokens equal and logprobs within `tol` until the first near-tie the engine resolves the
    other way (there, the engine's token must be as likely as the reference's within the gap and
    `tol`); returns how many steps were compared and where it stopped."""
    assert "error" not in res, f"{what}: {res}"
    worst = 0.0
    for step, (tok, lp) in enumerate(zip(res["tokens"], res["logprobs"], strict=True)):
        if tok != ref.tokens[step]:
            assert ref.gaps[step] < 2 * tol, (
                f"{what}: token {step} is {tok}, the reference's {ref.tokens[step]} leads by "
                f"{ref.gaps[step]:.4f} (> 2 x tol {tol:.4f})"
            )
            assert abs(lp - ref.logprobs[step]) <= ref.gaps[step] + tol, (
                f"{what}: at the near-tie of step {step} the engine's token has logprob {lp:.5f}, "
                f"the reference's {ref.logprobs[step]:.5f} (gap {ref.gaps[step]:.4f}, tol {tol:.4f})"
            )
            return {"steps": step, "stopped_at_near_tie": step, "worst": worst}
        worst = max(worst, abs(lp - ref.logprobs[step]))
        assert abs(lp - ref.logprobs[step]) <= tol, (
            f"{what}: logprob of step {step} is {lp:.5f}, reference {ref.logprobs[step]:.5f} (tol {tol:.4f})"
        )
    return {"steps": len(res["tokens"]), "stopped_at_near_tie": None, "worst": worst}


def noise(model, results: list[dict]) -> float:
    """Largest logprob difference on ordinary prompts, before any token differs."""
    delta = 0.0
    for res in results:
        ref = hf_reference.greedy(model, res["prompt_ids"], len(res["tokens"]))
        for step, (tok, lp) in enumerate(zip(res["tokens"], res["logprobs"], strict=True)):
            if tok != ref.tokens[step]:
                break
            delta = max(delta, abs(lp - ref.logprobs[step]))
    return delta


def token_prompt(sys_ids: list[int], chunks: list[list[int]], q_ids: list[int]) -> dict:
    return {
        "prompt_token_ids": sys_ids + [t for c in chunks for t in c] + q_ids,
        "chunk_spans": {"sys_len": len(sys_ids), "chunk_lens": [len(c) for c in chunks]},
    }


def reference_of(model, raw_tok, prompt, max_tokens: int, layout: str, recovery: str | None = None):
    """The HF reference of `prompt` (`hf_reference.Reference`), or with `recovery` = `qattn:...`
    the HF plan of that mode (an `hf_recovery.Outcome`: tokens, logprobs, gaps, and `compute`, the
    region tokens the plan computes)."""
    if recovery is not None:
        _, out, compute = cc.qattn_reference(model, raw_tok, prompt, max_tokens, recovery, layout)
        out.compute = compute
        return out
    if isinstance(prompt, dict):
        ids, spans = prompt["prompt_token_ids"], prompt["chunk_spans"]
        sys_len, chunk_lens = spans["sys_len"], spans["chunk_lens"]
    else:
        exp = cc.expected_structure(raw_tok, prompt)
        ids, sys_len, chunk_lens = exp.token_ids, exp.sys_len, exp.chunk_lens
    # An ordinary prompt (no documents) is plain causal decoding in either layout.
    return hf_reference.greedy(
        model,
        ids,
        max_tokens,
        sys_len=sys_len,
        chunk_lens=chunk_lens,
        layout=layout if chunk_lens else "overlap",
    )


def check_engine(name: str, models_dir: Path, layout: str) -> None:
    """Ordinary, cold, warm, reordered and 1-token chunked prompts (some joining decode batches),
    then `qattn` requests one by one and batched, against the reference in `layout`."""
    raw_tok = cc.reference_tools(models_dir, name)[1]
    ordinary = ordinary_prompts(300)
    docs = [cc.document(310 + i, 90) for i in range(4)] + [cc.UNICODE_DOC]
    cold = [cc.chunked(cc.SYS, docs[:3], "What is first?"), cc.chunked(cc.SYS, docs[2:], "Which is French?")]
    reordered = [
        cc.chunked(cc.SYS, [docs[4], docs[0], docs[2]], "Mixed?"),
        cc.chunked(cc.SYS, [docs[1], docs[3]], "Two?"),
    ]
    # 1-token capture steps: a SYS of exactly one 16-token page, cached first, then documents of
    # one token each whose chunk prefills (SYS from the prefix cache, one token computed) join a
    # batch of decodes, so the step holding them has one query token per request: vLLM's
    # full-graph case. Also a BOS-only SYS ("# # doc # # question"), a 1-token SYS prefill.
    sys16 = raw_tok.encode(cc.SYS + " " + cc.SYS).ids[:16]
    letters = [raw_tok.encode(ch, add_special_tokens=False).ids for ch in "qxzjkv"]
    letters = [ids for ids in letters if len(ids) == 1]
    q_ids = raw_tok.encode(" And now?", add_special_tokens=False).ids
    seed_sys = token_prompt(sys16, [raw_tok.encode(" seed doc", add_special_tokens=False).ids], q_ids)
    late = [token_prompt(sys16, [ids], q_ids) for ids in letters[:4]] + [
        cc.chunked("", [cc.document(330, 40)], "Empty system?")
    ]
    reuse = [
        token_prompt(sys16, [letters[2], letters[0], letters[1]], q_ids),
        cc.chunked("", [cc.document(330, 40)], "Empty system, again?"),
    ]
    qattn = [
        cc.chunked(cc.SYS, [docs[0], docs[1], docs[2]], "What is first in these documents?"),
        cc.chunked(cc.SYS, [docs[3], docs[0], docs[4], docs[1]], "And which one is the longest?"),
    ]
    rounds = [
        {"prompts": ordinary, "batch": True, "max_tokens": 24},
        {"prompts": cold, "max_tokens": 16},
        {"prompts": cold, "max_tokens": 16},
        {"prompts": reordered, "batch": True, "max_tokens": 16},
        {"prompts": [seed_sys], "max_tokens": 4},
        {"prompts": ordinary[:2], "late": late, "late_after": 6, "max_tokens": 48},
        {"prompts": reuse, "batch": True, "max_tokens": 16},
        {"prompts": qattn, "max_tokens": 16, "extra_args": {"chunk_cache_recovery": QATTN}},
        {"prompts": qattn, "batch": True, "max_tokens": 16, "extra_args": {"chunk_cache_recovery": QATTN}},
    ]
    env = {**ENV, "VLLM_CHUNK_CACHE_LAYOUT": layout}
    result = check_against_reference(f"{name}-{layout}", models_dir, name, rounds, ENGINE, env, layout)
    before, one_by_one, batched = result["states"][-3:]
    # Every qattn request scored and recomputed what its plan computes (none served unscored).
    assert one_by_one["selections"] - before["selections"] == len(qattn), one_by_one
    assert batched["selections"] - one_by_one["selections"] == len(qattn), batched
    planned = sum(len(ref.compute) for ref in result["qattn_plans"])
    assert batched["selected_tokens"] - before["selected_tokens"] == planned, (batched, planned)


def check_against_reference(
    report: str,
    models_dir: Path,
    name: str,
    rounds: list[dict],
    engine: dict,
    env: dict,
    layout: str = cc.DEFAULT_LAYOUT,
) -> dict:
    """Runs `rounds` (the first: ordinary prompts, the engine's noise) and checks every later answer
    against the HF reference within the derived tolerance; records and returns the result."""
    model, raw_tok = cc.reference_tools(models_dir, name)
    result = run_engine(models_dir / name, rounds, engine, env, dtype=DTYPE)
    delta = noise(model, result["rounds"][0])
    assert delta < DELTA_CAP, f"{name}: the engine is {delta:.3f} from the reference on ordinary prompts"
    tol = max(4 * delta, 2e-3)
    compared, result["qattn_plans"] = [], []
    for r, (rnd, res) in enumerate(zip(rounds, result["rounds"], strict=True)):
        if r == 0:
            continue
        recovery = rnd.get("extra_args", {}).get("chunk_cache_recovery")
        for prompt, out in zip(rnd["prompts"] + rnd.get("late", []), res, strict=True):
            ref = reference_of(model, raw_tok, prompt, len(out["tokens"]), layout, recovery)
            compared.append(compare(out, ref, tol, f"{report} round {r}"))
            if recovery:
                result["qattn_plans"].append(ref)
    assert sum(c["steps"] for c in compared) >= len(compared), "near-ties stopped most comparisons"
    for state in result["states"]:
        assert state["pinned_entries"] == 0 and state["users"] == 0 and state["prefills"] == 0, state
    record(
        report,
        {
            "engine": result["engine"],
            "delta": delta,
            "tol": tol,
            "answers": len(compared),
            "steps": sum(c["steps"] for c in compared),
            "near_tie_stops": sum(c["stopped_at_near_tie"] is not None for c in compared),
            "worst_logprob_diff": max(c["worst"] for c in compared),
            "cached": [[out.get("cached") for out in res] for res in result["rounds"]],
            "states": result["states"],
        },
    )
    if not ON_CPU:
        assert result["engine"]["dtype"] == "torch.bfloat16"
        assert not result["engine"]["enforce_eager"], result["engine"]
    return result


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_overlap_in_bf16_with_graphs_and_async_scheduling(models_dir: Path, name: str):
    check_engine(name, models_dir, "overlap")


def test_sequential_in_bf16_loads_through_the_triton_kernel(models_dir: Path):
    """Llama3 rope scaling: the loads re-rotate keys in the fused Triton kernel inside the engine."""
    check_engine("tiny-llama3", models_dir, "sequential")


# tiny-llama's K/V per token in bf16: 2 layers x (K, V) x 2 heads x 32 x 2 bytes.
TINY_LLAMA_TOKEN_BYTES = 2 * 2 * 2 * 32 * (4 if ON_CPU else 2)
POOL_PAGES = 32


def test_host_tier_copies_evicted_documents_back_into_the_pool(models_dir: Path):
    """A pool of 32 pages and 12 documents of ~7 pages: evicted entries go to (pinned) host memory
    and are copied back into the pool on the device instead of computed again."""
    pool_bytes = POOL_PAGES * 16 * TINY_LLAMA_TOKEN_BYTES
    env = {
        "VLLM_CHUNK_CACHE_SIZE_GB": str(pool_bytes / 2**30),
        "VLLM_CHUNK_CACHE_HOST_GB": str(4 * pool_bytes / 2**30),
    }
    docs = [cc.document(300 + i, 100) for i in range(12)]
    sets = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    prompts = [cc.chunked(cc.SYS, [docs[i] for i in s], f"Question on {s}?") for s in sets]
    shuffled = [cc.chunked(cc.SYS, [docs[i] for i in s[::-1]], f"Again {s}?") for s in sets]
    ordinary = ordinary_prompts(340)
    rounds = [
        {"prompts": ordinary, "batch": True, "max_tokens": 16},
        {"prompts": prompts, "max_tokens": 8},
        {"prompts": shuffled, "max_tokens": 8},
        {"prompts": prompts, "batch": True, "max_tokens": 8},
    ]
    result = check_against_reference("host-tier", models_dir, "tiny-llama", rounds, ENGINE, env)
    cold, warm, batched = result["states"][1:]
    assert cold["evictions"] > 0 and cold["host_bytes_written"] > 0, cold
    assert warm["host_hits"] >= 9 and warm["host_bytes_read"] > 0, warm
    assert batched["chunk_prefills"] == warm["chunk_prefills"], batched


def test_chunk_cache_next_to_offloading_connector(models_dir: Path):
    """vLLM's OffloadingConnector (CPU offloading, CUDA only) beside the chunk cache in a
    MultiConnector: chunked and ordinary prompts answered as the reference, cold and after a reset of
    the prefix cache; the ordinary prompts are then loaded back from the offloaded blocks."""
    offloading = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 2**28},
    }
    engine = {
        **ENGINE,
        "kv_transfer_config": {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [offloading]},
        },
    }
    chunked, ordinary = cc.next_to_a_block_store()
    rounds = [
        {"prompts": ordinary_prompts(610), "batch": True, "max_tokens": 16},
        {"prompts": chunked + ordinary, "max_tokens": 8},
        {"prompts": chunked + ordinary, "max_tokens": 8, "reset_prefix_cache": True},
    ]
    result = check_against_reference("offloading-connector", models_dir, "tiny-llama", rounds, engine, ENV)
    assert result["engine"]["scheduler"] in ("ChunkCacheScheduler", "ChunkCacheAsyncScheduler")
    cold, after_reset = result["states"][1:]
    assert (cold["hits"], cold["misses"]) == (1, 3), cold
    assert after_reset["misses"] - cold["misses"] == 3, after_reset  # the pool was dropped
    # Loaded from the offloaded blocks: the prefix cache was empty after the reset.
    assert all(res["cached"] > 0 for res in result["rounds"][2][2:]), result["rounds"][2][2:]
