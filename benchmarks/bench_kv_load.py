#!/usr/bin/env python3
"""Bandwidth of the CUDA pool → paged KV load (Triton), against the device's copy bandwidth.

    python -m benchmarks.bench_kv_load [--tokens N] [--heads H] [--head-size D] [--out FILE.json]

Moves N tokens of K and V from random pool rows into random paged-cache slots (flash NHD layout,
block size 16), with and without the rotary correction, and times the same bytes moved by a plain
device-to-device copy and by the unfused torch path (gather, rotate, scatter). Bandwidth counts
bytes read plus bytes written (K/V rows, rotation tables, row and slot indices). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from vllm_ascend_chunk.ops.rotary import RotarySpec, Rotation

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed_ms(fn, reps: int = 50) -> float:
    """Median milliseconds of `fn` over `reps` CUDA-event-timed calls, after warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kv_load: needs a CUDA GPU", file=sys.stderr)
        return 2
    from vllm_ascend_chunk.ops.triton_kv_load import load_into_paged

    dev, dtype, n, h, d = torch.device("cuda"), DTYPES[args.dtype], args.tokens, args.heads, args.head_size
    block_size = 16
    pool = torch.randn((2, 2 * n, h, d), device=dev, dtype=dtype)
    kv = torch.zeros((2 * n // block_size, 2, block_size, h, d), device=dev, dtype=dtype)
    key_cache, value_cache = kv.unbind(1)
    rows = torch.randperm(2 * n, device=dev)[:n]
    slots = torch.randperm(2 * n, device=dev)[:n]
    half = d // 2
    spec = RotarySpec(
        head_size=d,
        rotary_dim=d,
        is_neox_style=True,
        inv_freq=10000.0 ** (-torch.arange(half, dtype=torch.float64) / half),
    )
    rotation = Rotation.for_deltas(torch.randint(0, 100_000, (n,)), spec, dev)

    kv_bytes = 2 * n * h * d * pool.element_size()  # K and V of the moved tokens
    index_bytes = 2 * n * rows.element_size()
    table_bytes = 2 * n * half * 4
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def unfused() -> None:
        key = rotation.apply_(pool[0].index_select(0, rows))
        key_cache[slots // block_size, slots % block_size] = key
        value_cache[slots // block_size, slots % block_size] = pool[1].index_select(0, rows)

    runs = {
        "device_copy": (lambda: dst.copy_(src), 2 * kv_bytes),
        "triton_load_plain": (
            lambda: load_into_paged(pool[0], pool[1], rows, slots, key_cache, value_cache, None),
            2 * kv_bytes + index_bytes,
        ),
        "triton_load_rotate": (
            lambda: load_into_paged(pool[0], pool[1], rows, slots, key_cache, value_cache, rotation),
            2 * kv_bytes + index_bytes + table_bytes,
        ),
        "torch_unfused_rotate": (unfused, 2 * kv_bytes + index_bytes + table_bytes),
    }
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": n,
        "kv_heads": h,
        "head_size": d,
        "dtype": args.dtype,
        "kv_bytes_moved": kv_bytes,
        "runs": {},
    }
    for name, (fn, nbytes) in runs.items():
        ms = timed_ms(fn)
        result["runs"][name] = {"ms": round(ms, 4), "bytes": nbytes, "GB_per_s": round(nbytes / ms / 1e6, 1)}
    copy_bw = result["runs"]["device_copy"]["GB_per_s"]
    for run in result["runs"].values():
        run["fraction_of_copy"] = round(run["GB_per_s"] / copy_bw, 3)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
