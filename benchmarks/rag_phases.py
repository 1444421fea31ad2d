"""One configuration of the RAG benchmark on its own server: the workload's requests one at a
time (one sample each, with the counters they moved), then per concurrency level a Zipf stream
with that many requests in flight.
"""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.rag_servers import (
    CHUNK_HITS,
    CHUNK_MISSES,
    CONFIGS,
    COVER_FALLBACKS,
    PREFIX_HITS,
    PREFIX_QUERIES,
    SELECTED_TOKENS,
    counter_delta,
    make_server,
    read_counters,
    server_env,
    ttft_request,
)
from benchmarks.rag_summary import stats, summarize
from benchmarks.rag_tables import fmt
from harness import rag_workload
from harness.serve_util import VllmServer, openai_client, portable

OnSample = Callable[[dict], None]
Streams = dict[int, list[rag_workload.RagRequest]]


def run_requests(
    server: VllmServer,
    config: str,
    workload: rag_workload.RagWorkload,
    args: argparse.Namespace,
    on_sample: OnSample | None = None,
) -> list[dict]:
    """Send the workload's requests one at a time; one sample per request. A request with a
    recovery mode (phase "variant") goes only to a server with the chunk cache, with the mode
    in its `vllm_xargs`."""
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
        recovery = req.meta.get("recovery")
        if recovery and not CONFIGS[config]["chunk_cache"]:
            continue
        xargs = {"chunk_cache_recovery": recovery} if recovery else None
        result = ttft_request(client, args.served_name, workload.prompt(req), args.max_tokens, xargs=xargs)
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
            "selected_tokens": counter_delta(counters, after, SELECTED_TOKENS),
            "cover_fallbacks": counter_delta(counters, after, COVER_FALLBACKS),
            "end_s": time.perf_counter(),
        }
        counters = after
        samples.append(sample)
        if on_sample is not None:
            on_sample(sample)
    return samples


def run_concurrent(
    server: VllmServer,
    config: str,
    workload: rag_workload.RagWorkload,
    reqs: list[rag_workload.RagRequest],
    level: int,
    args: argparse.Namespace,
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


def _run_streams(
    server: VllmServer,
    config: str,
    workload: rag_workload.RagWorkload,
    streams: Streams,
    args: argparse.Namespace,
) -> dict[str, dict]:
    """Per concurrency level, its stream with that many requests in flight (`run_concurrent`)."""
    out = {}
    for level, reqs in streams.items():
        print(f"[{config}] concurrency {level}: {len(reqs)} requests", flush=True)
        c = run_concurrent(server, config, workload, reqs, level, args)
        out[str(level)] = c
        print(
            f"[{config}] concurrency {level}: {c['requests_per_s']:.2f} req/s, TTFT p50 "
            f"{c['p50']:.0f} ms p99 {c['p99']:.0f} ms, chunk hit rate "
            f"{fmt(c['chunk_hit_rate'], '.0%')}, {c['wall_s']:.0f} s",
            flush=True,
        )
    return out


def run_config(
    config: str,
    workload: rag_workload.RagWorkload,
    args: argparse.Namespace,
    log_path: Path | None = None,
    on_sample: OnSample | None = None,
    streams: Streams | None = None,
    started: tuple[VllmServer, float] | None = None,
) -> dict:
    """Start the configuration's server (or take `started`: a running server and its start-up
    seconds), send the workload, stop the server."""
    server = started[0] if started else make_server(config, args, log_path)
    result: dict = {
        "title": CONFIGS[config]["title"],
        "server_env": server_env(config, args),
        "server_command": portable(shlex.join(server.command[1:])),
        "server_log": server.log_path.name,
    }
    t0 = time.perf_counter()
    try:
        if started:
            result["startup_s"] = started[1]
            result["started_with_others"] = True
        else:
            server.start()
            result["startup_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        result["samples"] = run_requests(server, config, workload, args, on_sample)
        result["requests_wall_s"] = time.perf_counter() - t1
        if streams:
            result["concurrency"] = _run_streams(server, config, workload, streams, args)
        result["final_metrics"] = {
            k: v
            for k, v in server.metrics().items()
            if k.startswith(("vllm:chunk_cache_", "vllm:prefix_cache_")) and not k.endswith("_created")
        }
    finally:
        server.stop()
    result["summary"] = summarize(result["samples"])
    return result
