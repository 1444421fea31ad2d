"""The chunk path on the model families people serve (issue 56), each in engines of its own: cold,
warm, reordered, repeated documents, one document and a recovery mode per request, against the
independent HF reference (`harness/hf_reference.py`, the family's own transformers module). One
engine per family and layout (`FAMILIES`: which layouts run in CI; `docs/user/models.md` has the
matrix). Families the chunk cache does not apply to start with it off and answer exactly as vLLM
does with the switch off."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import chunk_cases as cc
from tests.helpers.engine_runner import run_engine

LAYOUTS = ["sequential", "overlap"]
# Every family of `scripts/make_tiny_models.py` the chunk cache serves, by what differs from Llama,
# and the layouts its engines run in CI: `sequential` (the default, where the family's RoPE moves
# loaded keys) for all; `overlap` for GLM-4, whose RoPE differs most. The other `overlap` cells
# (measured exact, ~30 s of engine each on 2 cores) run with CHUNK_CACHE_FAMILY_LAYOUTS=all: CI's
# budget holds ~3 minutes of new engines (docs/user/models.md, the matrix).
ALL = os.environ.get("CHUNK_CACHE_FAMILY_LAYOUTS") == "all"
SEQUENTIAL = ["sequential", *(["overlap"] if ALL else [])]
FAMILIES = {
    "tiny-qwen3": SEQUENTIAL,  # per-head q/k RMSNorm before RoPE
    "tiny-qwen3-moe": SEQUENTIAL,  # experts (vLLM patch 0021 on the CPU); `sequential` at TP=2
    "tiny-glm4": LAYOUTS,  # RoPE on half of each head, interleaved pairs
    "tiny-phi3": SEQUENTIAL,  # fused qkv, RoPE on three quarters of each head
    "tiny-mistral": SEQUENTIAL,
    "tiny-granite": SEQUENTIAL,  # embedding / attention / residual / logit multipliers
    "tiny-olmo2": SEQUENTIAL,  # RMSNorm over the whole q/k projection
}
# Small engines: eager (no compilation at start-up), a short context, few sequences.
ENGINE = {"max_model_len": 1024, "enforce_eager": True, "max_num_seqs": 4, "max_num_batched_tokens": 1024}
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
PARALLEL = {
    ("tiny-qwen3-moe", "sequential"): (TP2, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
}
WHATS = ["cold", "warm", "reordered, repeated, one document", "last per request"]


def family_rounds() -> list[dict]:
    """Cold (a document shared by two requests), warm, one batch of a reordered prompt, one with a
    document twice and one of a single document, and `last` asked per request (its last document
    computed with the question)."""
    docs = [cc.document(900 + i, 40 + 15 * i) for i in range(4)]
    first = [
        cc.chunked(cc.SYS, docs[:3], "What is first?"),
        cc.chunked(cc.SYS, [docs[3], docs[0]], "Which is longer?"),
    ]
    batch = [
        cc.chunked(cc.SYS, [docs[2], docs[0], docs[1]], "What is first?"),
        cc.chunked(cc.SYS, [docs[3], docs[1], docs[3]], "Twice?"),
        cc.chunked(cc.SYS, [docs[1]], "One document only?"),
    ]
    return [
        {"prompts": first},
        {"prompts": first},
        {"prompts": batch, "batch": True},
        {"prompts": first[:1], "extra_args": {"chunk_cache_recovery": "last"}},
    ]


_engines: dict[tuple[str, str], dict] = {}


def family_engine(models_dir: Path, name: str, layout: str) -> dict:
    """The one engine of `name` in `layout` (started on first use, shared)."""
    if (name, layout) not in _engines:
        engine, env = PARALLEL.get((name, layout), ({}, {}))
        _engines[name, layout] = run_engine(
            models_dir / name,
            family_rounds(),
            {**ENGINE, **engine},
            env={"VLLM_CHUNK_CACHE_LAYOUT": layout, **env},
        )
    return _engines[name, layout]


def check(models_dir: Path, name: str, layout: str, result: dict) -> None:
    """Every answer against the HF reference of the layout."""
    model, raw_tok = cc.reference_tools(models_dir, name)
    for i, (rnd, res, what) in enumerate(zip(family_rounds(), result["rounds"], WHATS, strict=True)):
        for prompt, got in zip(rnd["prompts"], res, strict=True):
            assert "error" not in got, got
            exp, ref = cc.reference(model, raw_tok, prompt, 8, layout, recovery_docs=int(i == 3))
            assert got["prompt_ids"] == exp.token_ids, f"{name} {layout} {what}: prompt ids"
            cc.assert_matches(got["tokens"], got["logprobs"], ref, f"{name} {layout} {what}")


@pytest.mark.parametrize(
    "name, layout", [(name, layout) for name, layouts in FAMILIES.items() for layout in layouts]
)
def test_family_is_exact_in_the_layout(models_dir: Path, name: str, layout: str):
    result = family_engine(models_dir, name, layout)
    check(models_dir, name, layout, result)
    counts = [(s["hits"], s["misses"]) for s in result["states"]]
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip([(0, 0), *counts], counts, strict=False)]
    assert steps == [(1, 4), (5, 0), (7, 0), (2, 0)], steps  # `last` never looks its document up
    assert result["states"][-1]["pinned_entries"] == 0


# Families the chunk cache does not apply to, one per kind, and the reason an engine logs.
OFF = {
    "tiny-gemma2-sw": "sliding-window attention",  # (Gemma-2/3)
    "tiny-mistral-sw": "sliding-window attention",  # (Mistral with a window)
    "tiny-gpt-oss": "sliding-window attention",  # sliding and full layers, sinks, experts
    "tiny-qwen3-next": "hybrid model",  # gated delta net and full layers
}
# Those served here, in the dtype vLLM's CPU kernels take (gpt-oss in float32 fails `expected
# scalar type BFloat16 but found Float`). Qwen3-Next does not run on vllm-cpu 0.23.0, chunk
# cache or not: its gated delta net refuses float32 (`CPU GDN attention requires BF16`) and in
# bfloat16 (weights too) fails `RuntimeError: Input tensor dtype mismatch`, also with
# VLLM_ENABLE_CHUNK_CACHE=false; its decision is checked on its config only.
OFF_ENGINES = {"tiny-gemma2-sw": "float32", "tiny-gpt-oss": "bfloat16"}
OFF_PROMPTS = [cc.chunked(cc.SYS, [cc.document(950, 40), cc.document(951, 30)], "Which?"), "A plain prompt."]


@pytest.mark.parametrize("name", list(OFF_ENGINES))
def test_family_the_chunk_cache_does_not_apply_to_is_served_as_vllm_serves_it(models_dir: Path, name: str):
    """The engine starts with the chunk cache on, which turns itself off for this engine (no
    connector): `# #` is text, and the answers are those of an engine with the switch off
    (unpatched vLLM)."""
    from tokenizers import Tokenizer

    rounds, dtype = [{"prompts": OFF_PROMPTS, "max_tokens": 4}], OFF_ENGINES[name]
    result = run_engine(models_dir / name, rounds, ENGINE, dtype=dtype)
    assert result["states"] == [{"preemptions": 0}]  # no chunk cache in that engine at all
    off = run_engine(models_dir / name, rounds, ENGINE, {"VLLM_ENABLE_CHUNK_CACHE": "false"}, dtype)
    raw_tok = Tokenizer.from_file(str(models_dir / name / "tokenizer.json"))
    assert [r["prompt_ids"] for r in result["rounds"][0]] == [raw_tok.encode(p).ids for p in OFF_PROMPTS]
    assert result["rounds"] == off["rounds"]


@pytest.mark.parametrize("name", [*FAMILIES, *OFF, "tiny-deepseek-v2"])
def test_which_families_the_chunk_cache_applies_to(models_dir: Path, name: str):
    """The engine's decision on each family's config, without an engine: served (and whether a
    rotation moves its keys: not DeepSeek's, whose k_pe ends each head), or off and why."""
    from vllm.config import ModelConfig

    from vllm_ascend_chunk.config.engine import ROPE_AT_THE_END, _not_single_kv_group, _why_not_sequential

    model = ModelConfig(str(models_dir / name), dtype="float32", max_model_len=1024)
    want, reason = OFF.get(name), _not_single_kv_group(model)
    assert reason == want if want is None else reason.startswith(want), reason
    if name not in OFF:  # the default layout: `sequential` where a rotation moves the keys
        assert _why_not_sequential(model) == (ROPE_AT_THE_END if name == "tiny-deepseek-v2" else None)
