#!/usr/bin/env python3
"""Self-check of the Chunk Cache NPU path, for Ascend users on real hardware.

    python -m tools.deploy.npu_selfcheck [--model DIR] [--dtype bfloat16] [--skip-generation]

1. Ops: every NPU op of `vllm_ascend_chunk.ops.npu` (the KV writer through vllm-ascend's own
   cache-write op, the fused rotary correction) and the torch rotary correction on the NPU, on
   random inputs, against the pure-torch references computed on the CPU. Outputs are poisoned
   first and every element is compared.
2. Generation: a short greedy generation in two fresh engines, chunk cache disabled then
   enabled. One document: the chunk path must give what plain vLLM gives for the same token ids
   (SYS + DOC + QUESTION; overlap and plain semantics coincide for one document). Three
   documents: cold, warm and text-prompt runs must agree. Sequences may part only at a near-tie
   of the reference (top-2 logprob gap below --tie-gap).

Prints PASS/FAIL per check; the exit status is 1 if any check failed. `--device cpu` runs the op
checks with the references standing in for the device ops (what the tests run without an NPU).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_ascend_chunk.ops.base import KVWriter, plain_reader
from vllm_ascend_chunk.ops.npu import (
    npu_apply_rotation_,
    npu_kv_writer,
    reshape_and_cache_reference,
    rotary_mul_reference,
)
from vllm_ascend_chunk.ops.rotary import RotarySpec, apply_rotation_, rotation_tables

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 128  # vllm-ascend's only kernel block size for GQA attention
POISON = -4242.0  # exact in float16 and bfloat16, never produced by the inputs

SYSTEM = "You answer questions about the documents below, briefly."
DOCS = (
    "The lighthouse on the north cape was built in 1871 and is painted red and white.",
    "Ferries to the island leave the harbour every hour between six and ten.",
    "The museum keeps a collection of old maps and opens on weekends only.",
)
QUESTION = "Question: when do the ferries leave?"


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str


# --------------------------------------------------------------------------------------------
# Op checks

MakeWriter = Callable[[tuple[torch.Tensor, torch.Tensor]], KVWriter]
Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, RotarySpec], torch.Tensor]
Check = tuple[str, Callable[[], tuple[bool, str]]]


def check_kv_writer(
    make_writer: MakeWriter,
    device: str,
    dtype: torch.dtype,
    num_kv_heads: int,
    head_size: int,
    seed: int,
    num_blocks: int = 5,
    num_tokens: int = 300,
) -> tuple[bool, str]:
    """Write random K/V at random distinct slots of poisoned caches; compare every element, then
    read the slots back as the pool is filled after a step (`plain_reader`)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    key, value = (torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype) for _ in "kv")
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens]
    expected = [torch.full(shape, POISON, dtype=dtype) for _ in "kv"]
    reshape_and_cache_reference(key, value, *expected, slots.to(torch.int32))
    caches = tuple(torch.full(shape, POISON, dtype=dtype, device=device) for _ in "kv")
    make_writer(caches)(key.to(device), value.to(device), slots.to(device))
    bad = sum(int((got.cpu() != want).sum()) for got, want in zip(caches, expected, strict=True))
    read = plain_reader(*caches)(slots.to(device))
    unread = sum(int((got.cpu() != want).sum()) for got, want in zip(read, (key, value), strict=True))
    return bad == unread == 0, (
        f"{bad} of {2 * expected[0].numel()} cache elements differ; "
        f"{unread} of {2 * key.numel()} read back differ"
    )


def check_rotation(
    rotate: Rotate,
    device: str,
    dtype: torch.dtype,
    neox: bool,
    rotary_dim: int,
    seed: int,
    head_size: int = 128,
    num_heads: int = 4,
    num_tokens: int = 96,
) -> tuple[bool, str]:
    """Rotate random keys by random deltas (some zero) on ``device``; compare with the CPU reference.

    Dims past rotary_dim and zero-delta rows must be bit-identical; the rest within two rounding
    steps of ``dtype`` at the keys' magnitude (a pairing, sign or table bug is off by O(1)).
    """
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    spec = RotarySpec(head_size=head_size, rotary_dim=rotary_dim, is_neox_style=neox, inv_freq=inv_freq)
    keys = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    deltas = torch.randint(-8192, 8192, (num_tokens,), generator=gen)
    deltas[::7] = 0
    cos, sin = rotation_tables(deltas, spec, torch.device("cpu"))
    want = apply_rotation_(keys.clone(), cos, sin, spec)
    got = rotate(keys.to(device), cos.to(device), sin.to(device), spec).cpu()
    exact = torch.zeros_like(keys, dtype=torch.bool)
    exact[:, :, rotary_dim:] = True
    exact[deltas == 0] = True
    tol = 2 * torch.finfo(dtype).eps * float(keys.abs().max())
    err = (got.double() - want.double()).abs()
    bad = int((exact & (got != want)).sum()) + int((~exact & ~(err <= tol)).sum())
    return bad == 0, (
        f"{bad} of {keys.numel()} elements off; max error {float(err.max()):.3g} (tolerance {tol:.3g})"
    )


def check_latent_rotation(
    rotate: Rotate,
    device: str,
    dtype: torch.dtype,
    seed: int,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    num_tokens: int = 96,
) -> tuple[bool, str]:
    """MLA's cache row (DeepSeek-V3: one KV head, a 512-dim latent, then the 64-dim rotated
    `k_pe`, interleaved pairs): `k_pe` rotated in place as a view of the row's last dims; the
    latent part must stay bit-identical, `k_pe` as `check_rotation` judges a key."""
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 10000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    spec = RotarySpec(head_size=rope_dim, rotary_dim=rope_dim, is_neox_style=False, inv_freq=inv_freq)
    rows = torch.randn(num_tokens, 1, kv_lora_rank + rope_dim, generator=gen).to(dtype)
    deltas = torch.randint(-8192, 8192, (num_tokens,), generator=gen)
    cos, sin = rotation_tables(deltas, spec, torch.device("cpu"))
    want = apply_rotation_(rows[..., kv_lora_rank:].clone(), cos, sin, spec)
    got_rows = rows.to(device)
    rotate(got_rows[..., kv_lora_rank:], cos.to(device), sin.to(device), spec)
    got_rows = got_rows.cpu()
    moved = int((got_rows[..., :kv_lora_rank] != rows[..., :kv_lora_rank]).sum())
    tol = 2 * torch.finfo(dtype).eps * float(rows.abs().max())
    err = (got_rows[..., kv_lora_rank:].double() - want.double()).abs()
    bad = int((~(err <= tol)).sum())
    return bad == moved == 0, (
        f"{moved} latent elements changed; {bad} of {want.numel()} k_pe elements off; "
        f"max error {float(err.max()):.3g} (tolerance {tol:.3g})"
    )


def op_checks(device: str, seed: int) -> Iterator[Check]:
    """Every op check, with the device ops on an NPU and the references standing in on the CPU."""
    if device == "cpu":

        def make_writer(pair):
            return npu_kv_writer(pair, write_op=reshape_and_cache_reference)

        def fused(keys, cos, sin, spec):
            return npu_apply_rotation_(keys, cos, sin, spec, rotary_mul=rotary_mul_reference)
    else:
        from vllm_ascend_chunk.ops.dispatch import make_kv_writer

        def make_writer(pair):  # the dispatch the worker uses, on the real platform
            return make_kv_writer(pair, None, None)

        fused = npu_apply_rotation_
    for i, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32)):
        name, seed_i = str(dtype).removeprefix("torch."), seed + i
        if dtype != torch.float32:  # the KV dtypes vllm-ascend's attention supports
            for heads, head_size in ((1, 128), (8, 128), (4, 64)):
                yield (
                    f"kv writer {name} heads={heads} head_size={head_size}",
                    functools.partial(check_kv_writer, make_writer, device, dtype, heads, head_size, seed_i),
                )
        ops = (("fused op", fused), ("torch ops", apply_rotation_))
        # rotary_dim 96: three quarters of the head (Phi-4-mini); 64 of 128: half (GLM-4 interleaved)
        for neox, rotary_dim, (label, rotate) in itertools.product((True, False), (128, 64, 96), ops):
            yield (
                f"rotation ({label}) {name} {'neox' if neox else 'gptj'} rotary_dim={rotary_dim}/128",
                functools.partial(check_rotation, rotate, device, dtype, neox, rotary_dim, seed_i),
            )
        for label, rotate in ops:
            yield (
                f"MLA k_pe rotation ({label}) {name}: 64 dims after a 512-dim latent",
                functools.partial(check_latent_rotation, rotate, device, dtype, seed_i),
            )


def run_checks(checks: Iterator[Check]) -> Iterator[Result]:
    """Each check's result; an exception inside one is that check's failure."""
    for name, check in checks:
        try:
            ok, detail = check()
        except Exception as e:  # a device op refusing its inputs is a failed check, not a crash
            ok, detail = False, f"{type(e).__name__}: {e}"
        yield Result(name, ok, detail)


# --------------------------------------------------------------------------------------------
# Generation checks (each engine in its own process)


def _generate(args: argparse.Namespace) -> dict:
    """Worker: greedy token ids, top-2 logprob gaps and prompt ids per prompt (see the docstring)."""
    from vllm import LLM, SamplingParams

    enabled = os.environ.get("VLLM_ENABLE_CHUNK_CACHE", "true").lower() in ("1", "true")
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=0,
        enforce_eager=args.enforce_eager,
    )
    tok = llm.get_tokenizer()
    sys_ids = tok.encode(SYSTEM)  # as vLLM tokenizes a completion prompt: with BOS
    doc_ids = [tok.encode(d, add_special_tokens=False) for d in DOCS]
    q_ids = tok.encode(QUESTION, add_special_tokens=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=2)

    def ids_prompt(docs: list[list[int]]) -> dict:
        prompt = {"prompt_token_ids": sys_ids + [t for d in docs for t in d] + q_ids}
        if enabled:
            prompt["chunk_spans"] = {"sys_len": len(sys_ids), "chunk_lens": [len(d) for d in docs]}
        return prompt

    def run(prompt) -> dict:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        gaps = []
        for step in out.outputs[0].logprobs:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        return {"prompt": list(out.prompt_token_ids), "tokens": list(out.outputs[0].token_ids), "gaps": gaps}

    if not enabled:
        return {"single": run(ids_prompt(doc_ids[:1]))}
    return {
        "single_cold": run(ids_prompt(doc_ids[:1])),
        "single_warm": run(ids_prompt(doc_ids[:1])),
        "multi_cold": run(ids_prompt(doc_ids)),
        "multi_warm": run(ids_prompt(doc_ids)),
        "multi_text": run(" # # ".join([SYSTEM, *DOCS, QUESTION])),
    }


def agreement(name: str, ref: dict, got: dict, tie_gap: float) -> Result:
    """Equal greedy tokens, or a first difference where the reference's top-2 gap < tie_gap."""
    for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"], strict=False)):
        if a != b:
            gap = ref["gaps"][i]
            return Result(
                name,
                gap < tie_gap,
                f"step {i}: token {b} vs {a}, reference top-2 gap {gap:.3g}"
                f" ({'a near-tie' if gap < tie_gap else 'not a near-tie'})",
            )
    if len(ref["tokens"]) != len(got["tokens"]):
        return Result(name, False, f"{len(got['tokens'])} tokens vs {len(ref['tokens'])}")
    return Result(name, True, f"{len(ref['tokens'])} tokens equal")


def generation_checks(args: argparse.Namespace) -> Iterator[Result]:
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            subprocess.run(
                [
                    sys.executable,
                    str(REPO / "scripts" / "make_tiny_models.py"),
                    "--out",
                    tmp,
                    "--only",
                    "tiny-llama",
                ],
                check=True,
            )
            model = str(Path(tmp) / "tiny-llama")
        runs = {}
        for enabled in ("false", "true"):
            out = Path(tmp) / f"generate-{enabled}.json"
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                str(out),
                "--model",
                model,
                "--dtype",
                args.dtype,
                "--max-tokens",
                str(args.max_tokens),
                "--max-model-len",
                str(args.max_model_len),
            ]
            if args.enforce_eager:
                cmd.append("--enforce-eager")
            proc = subprocess.run(cmd, env={**os.environ, "VLLM_ENABLE_CHUNK_CACHE": enabled})
            if proc.returncode != 0:
                yield Result(
                    f"engine with VLLM_ENABLE_CHUNK_CACHE={enabled}",
                    False,
                    f"exited with {proc.returncode} (its log is above)",
                )
                return
            runs[enabled] = json.loads(out.read_text())
    plain, chunked = runs["false"]["single"], runs["true"]
    for key in ("single_cold", "single_warm"):
        yield agreement(
            f"one document, chunk cache {key.split('_')[1]} vs disabled", plain, chunked[key], args.tie_gap
        )
    for key in ("multi_warm", "multi_text"):
        yield agreement(
            f"three documents, {key.split('_')[1]} vs cold", chunked["multi_cold"], chunked[key], args.tie_gap
        )
    same = chunked["multi_text"]["prompt"] == chunked["multi_cold"]["prompt"]
    yield Result(
        "text prompt tokenized as SYS + DOC_1..3 + QUESTION",
        same,
        "prompt token ids equal" if same else "prompt token ids differ",
    )


# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="npu", help="npu (default, needs torch_npu), npu:N, or cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-ops", action="store_true", help="skip the op checks")
    ap.add_argument("--skip-generation", action="store_true", help="skip the two-engine generation check")
    ap.add_argument(
        "--model",
        help="model directory or name (default: the repository's tiny Llama, "
        "generated offline into a temporary folder)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true", help="run the engines without ACL graphs")
    ap.add_argument(
        "--tie-gap",
        type=float,
        default=0.05,
        help="top-2 logprob gap (nats) under which greedy sequences may part",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one engine, results to this file
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        Path(args.worker).write_text(json.dumps(_generate(args)))
        return 0
    if args.device.startswith("npu"):
        import torch_npu  # noqa: F401  (registers the "npu" device)
    results = []
    checks = ([] if args.skip_ops else [run_checks(op_checks(args.device, args.seed))]) + (
        [] if args.skip_generation else [generation_checks(args)]
    )
    for group in checks:
        for r in group:
            print(f"{'PASS' if r.ok else 'FAIL'}  {r.name}: {r.detail}", flush=True)
            results.append(r)
    failed = sum(not r.ok for r in results)
    print(f"\n{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
