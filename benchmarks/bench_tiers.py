#!/usr/bin/env python3
"""Tier benchmark: the chunk cache's host-memory and remote tiers through real `vllm serve`
processes and a real Mooncake Store (master and store process on loopback).

    python -m benchmarks.bench_tiers            # ~8 min on a 2-core CPU
    python -m benchmarks.bench_tiers --quick    # ~5 min, same outputs

Part 1, one server per configuration, each sent the same Zipf stream of chunked prompts
(`rag_workload.zipf_stream`, 3 documents of ~512 tokens each) over a corpus `--corpus-factor`
times larger than the device pool, one request at a time:
  device   the device pool alone
  host     + a host-memory tier that holds the whole corpus (`VLLM_CHUNK_CACHE_HOST_GB`)
  remote   + the remote store (no host tier): documents evicted from the pool are read back
Per configuration: TTFT p50/p90 and the hit rate by tier (from `/metrics`).

Part 2, two servers A and B sharing one store: A answers `--sets` requests on fresh documents
(it computes and writes them); then B answers the same document sets in another order (remote
hits), then as many sets of documents nobody has (computed). Reported: B's TTFT on A's documents
against recomputing, for its first request and as p50s.

Outputs: benchmarks/<name>.json (every sample, summaries, the command, machine) and a PNG;
a summary on stdout. Ratios come from one run; absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.rag_servers import read_counters, ttft_request
from harness import rag_workload
from harness.machine import machine_info
from harness.mooncake_store import MooncakeProcs
from harness.serve_util import MODELS, REPO, VllmServer, openai_client, portable, tiny_serve_args

NAME = "tiny-rag"
TIER_COUNTERS = {
    "device": "vllm:chunk_cache_hits_total",
    "host": "vllm:chunk_cache_host_hits_total",
    "remote": "vllm:chunk_cache_remote_hits_total",
    "miss": "vllm:chunk_cache_misses_total",
}
WRITTEN = "vllm:chunk_cache_remote_bytes_written_total"
DOCS_PER_REQUEST = 3


def token_bytes(model: Path) -> int:
    """K/V bytes of one token in every layer (float32)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4


def server(args, log_dir: Path, label: str, **env: str) -> VllmServer:
    base = {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CHUNK_CACHE_SIZE_GB": f"{args.pool_gb:.6f}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    }
    cli = tiny_serve_args(NAME, 8192)
    return VllmServer(args.model, cli, env={**base, **env}, log_path=log_dir / f"{label}.log")


def remote_env(store: MooncakeProcs) -> dict[str, str]:
    return {
        "VLLM_CHUNK_CACHE_REMOTE_MASTER": store.master_address,
        "VLLM_CHUNK_CACHE_REMOTE_METADATA": store.metadata_server,
        "VLLM_CHUNK_CACHE_REMOTE_LOCAL_HOST": "127.0.0.1",
    }


def send(srv: VllmServer, workload: rag_workload.RagWorkload, requests, what: str) -> list[dict]:
    """Requests one at a time: TTFT and which tier served each document (metrics deltas)."""
    client = openai_client(srv.url, timeout=900)
    client.completions.create(model=NAME, prompt="warm up", max_tokens=2)  # a fresh server's first
    samples = []
    before = read_counters(srv)
    for req in requests:
        result = ttft_request(client, NAME, workload.prompt(req), max_tokens=2)
        after = read_counters(srv, before, tuple(TIER_COUNTERS.values()))
        tiers = {t: after.get(c, 0.0) - before.get(c, 0.0) for t, c in TIER_COUNTERS.items()}
        samples.append({"what": what, "docs": req.doc_ids, "ttft_ms": 1000 * result["ttft_s"], **tiers})
        before = after
    return samples


def settle_writes(srv: VllmServer) -> None:
    """Until the server's remote writes stop growing (counters move with engine steps)."""
    client, last = openai_client(srv.url, timeout=60), -1.0
    for _ in range(100):
        client.completions.create(model=NAME, prompt="ping", max_tokens=1)
        now = srv.metrics().get(WRITTEN, 0.0)
        if now == last and now > 0:
            return
        last = now
        time.sleep(0.2)


def summary(samples: list[dict]) -> dict:
    ttft = sorted(s["ttft_ms"] for s in samples)
    served = {t: sum(s[t] for s in samples) for t in TIER_COUNTERS}
    total = sum(served.values())
    return {
        "requests": len(samples),
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p90_ms": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "occurrences": served,
        "hit_rate": (total - served["miss"]) / total if total else None,
    }


def part_tiers(args, log_dir: Path, store: MooncakeProcs) -> dict:
    rng = random.Random(args.seed)
    stream = rag_workload.zipf_stream(
        rng, args.requests, corpus_size=args.corpus, docs_per_request=(DOCS_PER_REQUEST,), zipf_s=args.zipf
    )
    workload = rag_workload.RagWorkload(requests=stream)
    configs = {
        "device": {},
        "host": {"VLLM_CHUNK_CACHE_HOST_GB": f"{args.pool_gb * (args.corpus_factor + 1):.6f}"},
        "remote": remote_env(store),
    }
    results = {}
    for name, env in configs.items():
        with server(args, log_dir, name, **env) as srv:
            samples = send(srv, workload, stream, name)
        results[name] = {"samples": samples, "summary": summary(samples)}
        print(f"{name:>7}: {results[name]['summary']}", flush=True)
    return results


def part_two_instances(args, log_dir: Path, store: MooncakeProcs) -> dict:
    seeds = iter(range(rag_workload.COLD_SEEDS, rag_workload.COLD_SEEDS + 10_000))
    shared = [[next(seeds) for _ in range(DOCS_PER_REQUEST)] for _ in range(args.sets)]
    fresh = [[next(seeds) for _ in range(DOCS_PER_REQUEST)] for _ in range(args.sets)]
    questions = iter(range(10_000))

    def reqs(sets: list[list[int]], tag: str) -> list[rag_workload.RagRequest]:
        return [rag_workload.RagRequest(tag, s, next(questions)) for s in sets]

    reordered = [s[1:] + s[:1] for s in shared]
    workload = rag_workload.RagWorkload()
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(server(args, log_dir, "instance-a", **remote_env(store)))
        b = stack.enter_context(server(args, log_dir, "instance-b", **remote_env(store)))
        computed_by_a = send(a, workload, reqs(shared, "a"), "A computes")
        settle_writes(a)
        remote = send(b, workload, reqs(reordered, "b-remote"), "B on A's documents")
        recompute = send(b, workload, reqs(fresh, "b-fresh"), "B on new documents")
    p50 = {
        k: statistics.median(s["ttft_ms"] for s in v)
        for k, v in {"remote": remote, "recompute": recompute}.items()
    }
    return {
        "samples": computed_by_a + remote + recompute,
        "b_remote_ttft_p50_ms": p50["remote"],
        "b_recompute_ttft_p50_ms": p50["recompute"],
        "speedup_p50": p50["recompute"] / p50["remote"],
        "speedup_first_request": recompute[0]["ttft_ms"] / remote[0]["ttft_ms"],
        "b_remote_hits": sum(s["remote"] for s in remote),
        "b_misses_on_a_documents": sum(s["miss"] for s in remote),
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers, two = report["tiers"], report["two_instances"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    names, colors = list(tiers), ["grey", "tab:blue", "tab:green"]
    ax1.bar(names, [tiers[n]["summary"]["ttft_p50_ms"] for n in names], color=colors)
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.set_title(f"corpus {report['corpus_factor']:g}x the device pool")
    ax2.bar(names, [100 * (tiers[n]["summary"]["hit_rate"] or 0) for n in names], color=colors)
    ax2.set_ylabel("hit rate, every tier (%)")
    ax3.bar(
        ["B: A's documents\n(remote hits)", "B: new documents\n(computed)"],
        [two["b_remote_ttft_p50_ms"], two["b_recompute_ttft_p50_ms"]],
        color=["tab:green", "grey"],
    )
    ax3.set_ylabel("TTFT p50 (ms)")
    ax3.set_title(f"two instances: {two['speedup_p50']:.1f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=MODELS / "bench-llama")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--corpus", type=int, help="documents in the corpus (default 32, quick 24)")
    ap.add_argument("--corpus-factor", type=float, default=4.0, help="corpus size / device pool size")
    ap.add_argument("--requests", type=int, help="stream requests per configuration (default 40, quick 20)")
    ap.add_argument("--sets", type=int, help="document sets in the two-instance part (default 6, quick 3)")
    ap.add_argument("--zipf", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="tiers_cpu", help="output name under results/tiers/")
    args = ap.parse_args(argv)
    args.corpus = args.corpus or (24 if args.quick else 32)
    args.requests = args.requests or (20 if args.quick else 40)
    args.sets = args.sets or (3 if args.quick else 6)
    doc_tokens = 640  # a "~512-token" document is 520-600 tokens; with SYSTEM, in whole pages
    corpus_bytes = args.corpus * doc_tokens * token_bytes(args.model)
    args.pool_gb = corpus_bytes / args.corpus_factor / 2**30

    log_dir = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    store = MooncakeProcs(log_dir, store_bytes=4 * corpus_bytes)
    try:
        store.start()
        report = {
            "command": portable(" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])),
            "model": portable(args.model),
            "corpus_documents": args.corpus,
            "corpus_factor": args.corpus_factor,
            "pool_gb": args.pool_gb,
            "machine": machine_info(),
            "tiers": part_tiers(args, log_dir, store),
            "two_instances": part_two_instances(args, log_dir, store),
        }
    finally:
        store.stop()
    out = REPO / "results" / "tiers" / args.out
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    two = report["two_instances"]
    print(
        f"two instances: B on A's documents {two['b_remote_ttft_p50_ms']:.0f} ms p50, recompute "
        f"{two['b_recompute_ttft_p50_ms']:.0f} ms: {two['speedup_p50']:.1f}x (first request "
        f"{two['speedup_first_request']:.1f}x); remote hits {two['b_remote_hits']:.0f}, misses "
        f"{two['b_misses_on_a_documents']:.0f}"
    )
    print(f"wrote {portable(out.with_suffix('.json'))} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
