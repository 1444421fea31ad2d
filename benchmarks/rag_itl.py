"""Decode cost of the chunk cache (`bench_rag --itl N`): inter-token latency of ordinary and
chunked prompts on the chunk-off (`prefix`) and chunk-on (`chunk`) servers side by side.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.rag_servers import CHUNK_HITS, ITL_COUNT, ITL_SUM, make_server, ttft_request
from benchmarks.rag_summary import stats
from benchmarks.rag_tables import fmt
from harness import rag_workload
from harness.serve_util import VllmServer, openai_client, portable

if TYPE_CHECKING:
    import openai

ITL_CONFIGS = ("prefix", "chunk")


def itl_prompts(args: argparse.Namespace) -> tuple[rag_workload.RagWorkload, list[tuple[str, str]]]:
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


def run_itl(args: argparse.Namespace, log_dir: Path) -> dict:
    """Decode cost: the chunk-off (`prefix`) and chunk-on (`chunk`) servers both up, taking turns
    on the same prompts (which goes first alternates), so drifting load on the cores falls on both
    alike; the server not measured is paused (SIGSTOP) meanwhile, or it takes the cores now and
    then (seen: hits of 30 ms took 500-1,000 ms, with slow decodes, about once per round).
    `args.itl_tokens` streamed tokens per request, ignore_eos. ITL per request: vLLM's own
    inter-token latency histogram (engine-core timestamps), and as the client saw it (the mean
    gap between streamed token events after the first)."""
    _, prompts = itl_prompts(args)
    servers: dict[str, VllmServer] = {}
    result: dict = {
        "tokens": args.itl_tokens,
        "docs": args.itl_docs,
        "rounds": args.itl,
        "servers": {},
        "samples": [],
    }
    try:
        for config in ITL_CONFIGS:
            servers[config] = _start_itl_server(config, args, log_dir)
            result["servers"][config] = {
                "server_command": portable(shlex.join(servers[config].command[1:])),
                "server_env": servers[config].env,
            }
        clients = {c: openai_client(s.url, timeout=900) for c, s in servers.items()}
        for config in servers:  # first sends: prefix cache, chunk pool, compiled paths warm
            for _, prompt in prompts[:2]:
                ttft_request(clients[config], args.served_name, prompt, args.itl_tokens, ignore_eos=True)
        for i, (kind, prompt) in enumerate(prompts):
            order = ITL_CONFIGS if i % 4 < 2 else ITL_CONFIGS[::-1]
            for config in order:
                sample = _measure(servers, clients[config], config, prompt, args)
                result["samples"].append({"index": i, "kind": kind, "config": config, **sample})
                _show(result["samples"][-1])
        result["chunk_hits"] = servers["chunk"].metrics().get(CHUNK_HITS)
    finally:
        for server in servers.values():
            server.stop()
    result["summary"] = summarize_itl(result["samples"])
    return result


def _start_itl_server(config: str, args: argparse.Namespace, log_dir: Path) -> VllmServer:
    """The configuration's server with the ITL KV budget (two run at once), started."""
    server = make_server(
        config,
        args,
        log_dir / f"{args.out.stem}_itl_{config}.log",
        kv_space_gb=args.itl_kv_space_gb,
        pool_gb=min(args.pool_gb, args.itl_kv_space_gb / 4),
    )
    server.start()
    return server


def _measure(
    servers: dict[str, VllmServer], client: openai.OpenAI, config: str, prompt: str, args: argparse.Namespace
) -> dict:
    """`prompt` on the configuration's server, the other one paused: TTFT, ITL (server and client)."""
    (other,) = (s for c, s in servers.items() if c != config)
    with other.paused():
        before = servers[config].metrics()
        r = ttft_request(client, args.served_name, prompt, args.itl_tokens, ignore_eos=True)
        itl = server_itl(servers[config], before, r["completion_tokens"])
    return {
        "ttft_ms": 1000 * r["ttft_s"],
        "itl_ms": 1000 * itl if itl is not None else None,
        "client_itl_ms": 1000 * r["itl_s"] if r["itl_s"] is not None else None,
        "completion_tokens": r["completion_tokens"],
        "prompt_tokens": r["prompt_tokens"],
    }


def _show(sample: dict) -> None:
    print(
        f"[itl] {sample['index']:>3} {sample['kind']:<8} {sample['config']:<6} "
        f"{sample['prompt_tokens']:>5} tok  "
        f"TTFT {sample['ttft_ms']:7.1f} ms  ITL {fmt(sample['itl_ms'], '.2f')} ms "
        f"(client {fmt(sample['client_itl_ms'], '.2f')} ms)",
        flush=True,
    )


def summarize_itl(samples: list[dict]) -> dict:
    """Per kind of prompt and configuration: ITL statistics (server's and client's); per kind,
    the chunk-on overhead from the means, the p50s and the median of the per-round ratios."""
    summary = {}
    for kind in ("ordinary", "chunked"):
        for config in ITL_CONFIGS:
            picked = [s for s in samples if s["kind"] == kind and s["config"] == config]
            summary[f"{kind}_{config}"] = stats([s["itl_ms"] for s in picked if s["itl_ms"] is not None])
            summary[f"{kind}_{config}_client"] = stats(
                [s["client_itl_ms"] for s in picked if s["client_itl_ms"] is not None]
            )
        off, on = summary[f"{kind}_prefix"], summary[f"{kind}_chunk"]
        # Per-round ratios too: each pair ran back to back, so their median is robust to drift.
        pairs = _round_pairs(samples, kind)
        summary[f"{kind}_overhead_mean"] = on["mean"] / off["mean"] - 1 if on["n"] and off["n"] else None
        summary[f"{kind}_overhead_p50"] = on["p50"] / off["p50"] - 1 if on["n"] and off["n"] else None
        summary[f"{kind}_overhead_paired_median"] = (
            statistics.median(b / a for a, b in pairs) - 1 if pairs else None
        )
        c_off, c_on = summary[f"{kind}_prefix_client"], summary[f"{kind}_chunk_client"]
        summary[f"{kind}_overhead_client_mean"] = (
            c_on["mean"] / c_off["mean"] - 1 if c_on["n"] and c_off["n"] else None
        )
    return summary


def _round_pairs(samples: list[dict], kind: str) -> list[tuple[float, float]]:
    """(chunk off, chunk on) ITL of each round's prompt of `kind`, where both have one."""
    return [
        (a["itl_ms"], b["itl_ms"])
        for a in samples
        for b in samples
        if a["index"] == b["index"]
        and a["kind"] == kind
        and a["config"] == "prefix"
        and b["config"] == "chunk"
        and a["itl_ms"]
        and b["itl_ms"]
    ]
