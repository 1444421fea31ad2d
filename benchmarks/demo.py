#!/usr/bin/env python3
"""Demo: a short RAG workload through a real `vllm serve` with the chunk cache on.

    python -m benchmarks.demo [--out DIR] [--model DIR]      (scripts/demo.sh sets up, then runs this)

Starts `vllm serve` on the benchmark model (bench-llama: 6 layers, 512 wide, random weights) and
sends, one at a time, prompts `SYSTEM # # DOC_1 # # ... # # DOC_n # # QUESTION` with documents of
~512 tokens: 1, 2, 4 and 8 new documents, each set again in a new order; a short stream of 4-8
documents drawn from a small corpus with skewed popularity; one 8-document set three times in
orders where no document keeps its position. For each request it prints the documents, the
chunk cache hits and misses (deltas of the server's `/metrics` counters) and the TTFT, then
writes a plot (TTFT vs documents, TTFT per request) and the samples under DIR (default demo-out/).
The workload and the server handling are `benchmarks/bench_rag.py`'s, in a smaller size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import bench_rag
from benchmarks.rag_phases import run_config
from benchmarks.rag_plot import plot
from benchmarks.rag_tables import fmt
from harness import rag_workload
from harness.serve_util import MODELS, REPO


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODELS / "bench-llama")
    ap.add_argument("--out", type=Path, default=REPO / "demo-out")
    opts = ap.parse_args()
    # The benchmark's server settings (float32, max_model_len 8192, 4 GiB KV of which 1 GiB pool).
    args = bench_rag.build_parser().parse_args(["--model", str(opts.model)])
    bench_rag.resolve_defaults(args)
    args.served_name = opts.model.name
    workload = rag_workload.build_workload(
        sweep_sizes=(1, 2, 4, 8),
        sweep_warm_repeats=1,
        cold_requests=0,
        corpus_size=8,
        stream_requests=6,
        docs_per_request=(4, 5, 6, 7, 8),
        shuffled_sets=1,
        shuffled_repeats=2,
        warmup_requests=1,
    )
    opts.out.mkdir(parents=True, exist_ok=True)
    print(
        f"demo: starting vllm serve on {opts.model.name} with the chunk cache on "
        f"(about a minute; log {opts.out / 'vllm-serve.log'})",
        flush=True,
    )
    print(f"\n{'#':>3}  {'phase':<8} {'kind':<5} {'documents':<32} {'hits':>4} {'misses':>6} {'TTFT ms':>9}")

    def row(s: dict) -> None:
        docs = " ".join(str(d % 1000) for d in s["docs"])
        hits = "-" if s["chunk_hits"] is None else f"{s['chunk_hits']:.0f}"
        misses = "-" if s["chunk_misses"] is None else f"{s['chunk_misses']:.0f}"
        print(
            f"{s['index']:>3}  {s['phase']:<8} {s['label'] or 'mixed':<5} {docs:<32} {hits:>4} {misses:>6} "
            f"{s['ttft_ms']:>9.1f}",
            flush=True,
        )

    start = time.perf_counter()
    result = run_config("chunk", workload, args, opts.out / "vllm-serve.log", row)
    plot_path = opts.out / "demo.png"
    plot({"configs": {"chunk": result}}, plot_path, f"demo: {opts.model.name}, chunk cache on")
    (opts.out / "demo.json").write_text(json.dumps(result, indent=1) + "\n")
    if not result["summary"]["metrics_available"]["chunk_cache"]:
        print("\n(the server exposes no vllm:chunk_cache_* metrics: hits and misses are unknown)")
    print(
        "\ndocuments: seed mod 1000 per phase; kind: cold = none seen before, warm = all seen "
        "before, mixed = some"
    )
    print("TTFT (ms, p50) vs documents, cold then warm (same documents, every one moved):")
    for n, sw in result["summary"]["sweep"].items():
        print(f"  {n} docs: {fmt(sw['cold_ms'])} -> {fmt(sw['warm_ms'])}")
    print(
        f"\nplot: {plot_path}\nsamples: {opts.out / 'demo.json'}  "
        f"(server start + {len(workload.requests)} requests in {time.perf_counter() - start:.0f} s)"
    )
    print("(random weights: the generated text is noise; this shows where the time goes.)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
