#!/usr/bin/env python3
"""What a paused remote store costs the requests that do not need it (issue 55): one `vllm serve`
(tiny Llama, the remote tier on a real Mooncake master and store process) through two windows of
the same traffic, the store running in the first and paused (SIGSTOP) for `--pause-s` in the second.

    python -m benchmarks.bench_store_pause --out results/tiers/store_pause_cpu.json   # ~3 min
    python -m benchmarks.bench_store_pause --repeats 3 --out ...   # ~9 min: 3 windows a phase

The traffic in each window: one client streaming ordinary prompts back to back (`--decode-tokens`
each, ignore_eos), whose inter-token latencies the server measures (engine-core timestamps of
consecutive tokens: each sample of `vllm:inter_token_latency_seconds`, recorded one by one by
`harness.itl_log`, since that histogram's lowest edge, 10 ms, is above most of them); a chunked
request every `--pool-every-s` whose documents are all in the device pool (TTFT samples); and
`--store-requests` chunked requests whose documents only the store holds (written by this server,
then dropped from its pool by a cache reset), sent while the store is paused in the second window
(with `--spinner`, the store keeps running and a busy loop runs on the spare CPU instead). Reported
per window: ITL mean, p50, p99 and stalls over 1 s, the longest wait for a token a client saw inside
the pause's span, the pool requests' TTFT p50, the store requests' TTFTs and the remote counters;
and the paused/running ratios. Ratios come from one run; with `--repeats` the windows alternate
(running, paused, running, ...) and each phase's are pooled (samples together, vLLM's histograms
summed; each window's figures are kept too).

Outputs: `--out` JSON (samples, summaries, ratios, the command, the machine) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from benchmarks.bench_tiers import settle_writes
from benchmarks.rag_servers import read_counters, ttft_request
from harness import itl_log, rag_workload
from harness.machine import machine_info
from harness.mooncake_store import MooncakeProcs
from harness.serve_util import MODELS, REPO, VllmServer, openai_client, portable, scrape, tiny_serve_args

NAME = "tiny-rag"
REMOTE = {
    "hits": "vllm:chunk_cache_remote_hits_total",
    "reads": "vllm:chunk_cache_remote_reads_total",
    "failures": "vllm:chunk_cache_remote_read_failures_total",
    "worker_misses": "vllm:chunk_cache_remote_read_misses_total",
    "errors": "vllm:chunk_cache_remote_errors_total",
    "up": "vllm:chunk_cache_remote_up",
}
DOCS_PER_REQUEST = 2
SPINNERS = {"nice19": ["nice", "-n", "19"], "idle": ["chrt", "--idle", "0"]}
"""How `--spinner` runs its busy loop."""
ITL = "vllm:inter_token_latency_seconds"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODELS / "tiny-llama")
    ap.add_argument("--pause-s", type=float, default=10.0, help="how long the store is paused")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S")
    ap.add_argument("--store-requests", type=int, default=3, help="chunked requests waiting on the store")
    ap.add_argument("--pool-every-s", type=float, default=0.5, help="a pool-resident chunked request every")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tokens per ordinary streamed request")
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument(
        "--repeats", type=int, default=1, help="pairs of windows (running, paused), pooled per phase"
    )
    ap.add_argument(
        "--spinner",
        choices=sorted(SPINNERS),
        help="instead of pausing the store in the second window, busy-loop a process on the last "
        "CPU (the one the worker is not bound to) for --pause-s, at nice 19 or in the idle "
        "scheduling class: what a stuck Mooncake call's spinning costs on its own",
    )
    ap.add_argument("--label", default="", help="what the run measures (e.g. the commit), kept in the JSON")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "tiers" / "store_pause_cpu.json")
    ap.add_argument("--log-dir", type=Path, help="server and store logs (default: a temporary directory)")
    return ap.parse_args(argv)


def itl_histogram(server: VllmServer) -> dict[float, float]:
    """vLLM's `vllm:inter_token_latency_seconds` (engine-core timestamps of consecutive tokens):
    upper bound (s) → cumulative count, and the sum under key -1."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[float, float] = {}
    for family in text_string_to_metric_families(scrape(server.url)):
        for sample in family.samples:
            if sample.name == ITL + "_bucket":
                le = float(sample.labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
            elif sample.name == ITL + "_sum":
                out[-1] = out.get(-1, 0.0) + sample.value
    return out


def quantile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of `values` (None: no values)."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q * len(ranked)) - 1)]


def itl_summary(itls_ms: list[float], delta: dict[float, float]) -> dict:
    """A window's ITLs: count, mean, p50 and p99 (nearest rank) and how many took over 1 s
    (stalls), from the samples; vLLM's histogram of them (`delta`: its growth over the window,
    upper bound (s) → cumulative count), kept beside them as that server's own account."""
    bounds = sorted(b for b in delta if b >= 0)
    return {
        "itl_count": len(itls_ms),
        "itl_mean_ms": statistics.fmean(itls_ms) if itls_ms else None,
        "itl_p50_ms": quantile(itls_ms, 0.5),
        "itl_p99_ms": quantile(itls_ms, 0.99),
        "itl_over_1s": sum(1 for t in itls_ms if t > 1000),
        "itl_histogram_count": delta.get(float("inf"), 0.0),
        "itl_buckets": {str(b): delta[b] for b in bounds},
    }


class Spinner:
    """`--spinner`: a busy loop on the last CPU, in place of the store's pause."""

    def __init__(self, kind: str) -> None:
        self.command = ["taskset", "-c", str((os.cpu_count() or 1) - 1), *SPINNERS[kind]]
        self.command += [sys.executable, "-c", "while True: pass"]

    def pause_for(self, seconds: float) -> None:
        spinner = subprocess.Popen(self.command)
        try:
            time.sleep(seconds)
            if spinner.poll() is not None:  # taskset or chrt refused: no loop ran
                raise RuntimeError(f"the spinner {self.command} exited ({spinner.returncode})")
        finally:
            spinner.kill()
            spinner.wait()


class Window:
    """One window of traffic: a decoding client, pool requests on a timer, store requests."""

    def __init__(
        self, server: VllmServer, args: argparse.Namespace, pool_docs: list[str], itls: Path
    ) -> None:
        self.server, self.args, self.pool_docs, self.itls = server, args, pool_docs, itls
        self.workload = rag_workload.RagWorkload(doc_tokens=args.doc_tokens)
        self.stop = threading.Event()
        self.gaps: list[tuple[float, float]] = []
        """(time since the window began, gap to the previous token of its request), seconds."""
        self.decodes: list[dict] = []
        """Per ordinary request: when it was sent, its TTFT."""
        self.pool: list[dict] = []
        self.store: list[dict] = []
        self.t0 = 0.0

    def run(self, store_docs: list[list[str]], pause: MooncakeProcs | Spinner | None, seed: int) -> dict:
        span = self.args.pause_s
        self.t0 = time.perf_counter()
        threads = [threading.Thread(target=self._decode, args=(seed,))]
        threads += [threading.Thread(target=self._pool_requests, args=(seed, span + 1.0))]
        for i, docs in enumerate(store_docs):  # spread over the pause's first half
            at = 1.0 + i * span / (2 * max(1, len(store_docs)))
            threads.append(threading.Thread(target=self._store_request, args=(docs, at, seed + i)))
        before = self.server.metrics()
        itl_before = itl_histogram(self.server)
        first = len(itl_log.read(self.itls))
        for t in threads:
            t.start()
        if pause is not None:
            time.sleep(0.5)
            pause.pause_for(span)
        else:
            time.sleep(0.5 + span)
        time.sleep(1.0)
        self.stop.set()
        for t in threads:
            t.join(timeout=120)
        after = read_counters(self.server, before, (REMOTE["reads"],))
        itl_after = itl_histogram(self.server)
        itls_ms = [1000 * t for t in itl_log.read(self.itls)[first:]]
        counters = {
            k: after.get(c, 0.0) - (0 if k == "up" else before.get(c, 0.0)) for k, c in REMOTE.items()
        }
        delta = {b: n - itl_before.get(b, 0.0) for b, n in itl_after.items()}
        if not itls_ms and delta.get(float("inf"), 0.0) > 0:
            raise RuntimeError(f"the server counted ITLs but recorded none in {self.itls}: see its log")
        return {
            **itl_summary(itls_ms, delta),
            **self.summary(counters),
            "itl_delta": delta,
            "itls_ms": itls_ms,
        }

    def _decode(self, seed: int) -> None:
        client = openai_client(self.server.url, timeout=300)
        n = 0
        while not self.stop.is_set():
            sent = time.perf_counter()
            stream = client.completions.create(
                model=NAME,
                prompt=rag_workload.question(seed * 1000 + n, 24),
                max_tokens=self.args.decode_tokens,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            n += 1
            times = [time.perf_counter() for chunk in stream if chunk.choices and chunk.choices[0].text]
            if not times:
                continue
            self.decodes.append({"sent_s": sent - self.t0, "ttft_ms": 1000 * (times[0] - sent)})
            self.gaps += [(t - self.t0, t - prev) for prev, t in zip([sent, *times], times, strict=False)]

    def _pool_requests(self, seed: int, until_s: float) -> None:
        client = openai_client(self.server.url, timeout=300)
        i = 0
        while time.perf_counter() - self.t0 < until_s:
            start = time.perf_counter() - self.t0
            q = rag_workload.question(seed * 1000 + 500 + i, 16)
            r = ttft_request(client, NAME, rag_workload.chunked(self.workload.system, self.pool_docs, q), 1)
            self.pool.append({"at_s": start, "ttft_ms": 1000 * r["ttft_s"]})
            i += 1
            time.sleep(max(0.0, self.args.pool_every_s - r["e2e_s"]))

    def _store_request(self, docs: list[str], at_s: float, seed: int) -> None:
        time.sleep(max(0.0, at_s - (time.perf_counter() - self.t0)))
        client = openai_client(self.server.url, timeout=300)
        q = rag_workload.question(seed * 1000 + 900, 16)
        r = ttft_request(client, NAME, rag_workload.chunked(self.workload.system, docs, q), 1)
        self.store.append({"at_s": at_s, "ttft_ms": 1000 * r["ttft_s"]})

    def summary(self, counters: dict) -> dict:
        """As the clients saw it: the longest wait for a token of an ordinary request inside the
        pause's span (a gap, or its first token), the pool and store requests' TTFTs. (Single
        gaps come in bursts from the API server on a busy 2-core machine: the ITL quantiles are
        the engine's, `itl_summary`.)"""
        lo, hi = 0.5, 0.5 + self.args.pause_s
        gaps = [g for t, g in self.gaps if lo <= t <= hi]
        return {
            "longest_wait_ms": 1000 * max(gaps, default=0.0),
            "decode_ttft_max_ms": max(
                (d["ttft_ms"] for d in self.decodes if lo <= d["sent_s"] <= hi), default=None
            ),
            "pool_ttft_p50_ms": statistics.median(s["ttft_ms"] for s in self.pool) if self.pool else None,
            "pool_ttft_max_ms": max((s["ttft_ms"] for s in self.pool), default=None),
            "store_ttft_ms": [s["ttft_ms"] for s in sorted(self.store, key=lambda s: s["at_s"])],
            "remote": counters,
            "samples": {
                "decodes": self.decodes,
                "pool": self.pool,
                "store": self.store,
            },
        }


def prime(server: VllmServer, args: argparse.Namespace, docs: list[str]) -> None:
    """Compute `docs` (so the server writes them to the store), then drop them from its pool."""
    client = openai_client(server.url, timeout=300)
    workload = rag_workload.RagWorkload(doc_tokens=args.doc_tokens)
    for i in range(0, len(docs), DOCS_PER_REQUEST):
        q = rag_workload.question(7_000 + i, 16)
        ttft_request(
            client, NAME, rag_workload.chunked(workload.system, docs[i : i + DOCS_PER_REQUEST], q), 1
        )
    settle_writes(server)
    r = requests.post(f"{server.url}/reset_prefix_cache", params={"reset_external": "true"}, timeout=60)
    r.raise_for_status()


def pooled(windows: list[dict]) -> dict:
    """One phase's windows as one: their samples together, their ITL histograms summed."""
    delta: dict[float, float] = {}
    for w in windows:
        for b, n in w["itl_delta"].items():
            delta[b] = delta.get(b, 0.0) + n
    samples = {k: [s for w in windows for s in w["samples"][k]] for k in windows[0]["samples"]}
    itls_ms = [t for w in windows for t in w["itls_ms"]]
    samples["itls_ms"] = [round(t, 3) for t in itls_ms]
    return {
        **itl_summary(itls_ms, delta),
        "longest_wait_ms": max(w["longest_wait_ms"] for w in windows),
        "decode_ttft_max_ms": max(w["decode_ttft_max_ms"] or 0.0 for w in windows),
        "pool_ttft_p50_ms": statistics.median(s["ttft_ms"] for s in samples["pool"]),
        "pool_ttft_max_ms": max(s["ttft_ms"] for s in samples["pool"]),
        "store_ttft_ms": [t for w in windows for t in w["store_ttft_ms"]],
        "remote": {
            k: windows[-1]["remote"][k] if k == "up" else sum(w["remote"][k] for w in windows)
            for k in windows[0]["remote"]
        },
        "samples": samples,
    }


def run(args: argparse.Namespace, log_dir: Path) -> dict:
    workload = rag_workload.RagWorkload(doc_tokens=args.doc_tokens)
    n = args.store_requests * DOCS_PER_REQUEST
    stored = [workload.doc(rag_workload.COLD_SEEDS + 5_000 + i) for i in range(2 * n * args.repeats)]
    pool_docs = [workload.doc(rag_workload.COLD_SEEDS + 6_000 + i) for i in range(DOCS_PER_REQUEST)]
    result: dict = {}
    # The master keeps the paused store's memory: with Mooncake's 10 s default, a 10 s pause
    # sometimes dropped it, and with it every later window's documents (fast misses, no waits).
    store = MooncakeProcs(log_dir, client_ttl_s=math.ceil(args.pause_s) + 10).start()
    result["store_client_ttl_s"] = store.client_ttl_s
    try:
        env = {
            **store.server_env(timeout_s=args.timeout_s),
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CHUNK_CACHE_SIZE_GB": "0.25",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
        }
        itls = log_dir / "itl.log"
        recorder = itl_log.plugin_env(log_dir / "itl-plugin", itls)
        cli = tiny_serve_args(NAME)
        with VllmServer(args.model, cli, env={**env, **recorder}, log_path=log_dir / "server.log") as server:
            result["server_command"] = portable(shlex.join(server.command[1:]))
            result["server_env"] = {k: v for k, v in env.items() if "REMOTE_M" not in k}
            prime(server, args, stored)
            client = openai_client(server.url, timeout=300)
            ttft_request(
                client, NAME, rag_workload.chunked(workload.system, pool_docs, "Warm?"), 2
            )  # pool docs in
            groups = [stored[i : i + DOCS_PER_REQUEST] for i in range(0, len(stored), DOCS_PER_REQUEST)]
            windows: dict[str, list[dict]] = {"running": [], "paused": []}
            second = Spinner(args.spinner) if args.spinner else store
            for i in range(2 * args.repeats):  # running, paused, running, ...
                phase, pause = ("running", None) if i % 2 == 0 else ("paused", second)
                docs = groups[i * args.store_requests : (i + 1) * args.store_requests]
                windows[phase].append(Window(server, args, pool_docs, itls).run(docs, pause, seed=i))
                print(f"{phase}: {_brief(windows[phase][-1])}", flush=True)
                time.sleep(args.timeout_s + 2)  # readers stuck in the paused store come back
    finally:
        store.stop()
    for phase, ws in windows.items():
        result[phase] = pooled(ws)
        result[f"{phase}_windows"] = [
            {k: v for k, v in w.items() if k not in ("samples", "itl_delta", "itls_ms")} for w in ws
        ]
    run_ = result["running"]
    paused = result["paused"]
    result["ratios"] = {
        k: paused[k] / run_[k] if paused[k] and run_[k] else None
        for k in ("itl_mean_ms", "itl_p50_ms", "itl_p99_ms", "decode_ttft_max_ms", "pool_ttft_p50_ms")
    }
    return result


def _brief(window: dict) -> str:
    keys = (
        "itl_mean_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "itl_over_1s",
        "decode_ttft_max_ms",
        "pool_ttft_p50_ms",
    )
    return ", ".join(f"{k} {window[k]:.1f}" for k in keys if window[k] is not None) + (
        f", store TTFTs {[round(t) for t in window['store_ttft_ms']]}, remote {window['remote']}"
    )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (dist, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for phase, color in (("running", "tab:blue"), ("paused", "tab:red")):
        w = result[phase]
        itls = sorted(w["samples"]["itls_ms"])
        dist.step(itls, [(i + 1) / len(itls) for i in range(len(itls))], where="post", color=color)
        label = f"store {phase}: p50 {w['itl_p50_ms']:.2f}, p99 {w['itl_p99_ms']:.2f} ms"
        dist.plot([], [], color=color, label=label)
        for kind, marker in (("pool", "o"), ("store", "x")):
            samples = w["samples"][kind]
            label = f"{phase}: docs in {kind}"
            ttft.plot(
                [s["at_s"] for s in samples],
                [s["ttft_ms"] for s in samples],
                marker,
                color=color,
                label=label,
            )
    dist.set_xscale("log")
    longest = max(max(result[phase]["samples"]["itls_ms"]) for phase in ("running", "paused"))
    ticks = [2**k for k in range(11) if 2**k <= longest]
    dist.set_xticks(ticks, [str(t) for t in ticks])
    dist.minorticks_off()
    dist.set_xlabel("ITL (ms), engine-side")
    dist.set_ylabel("fraction of tokens at or below")
    dist.legend(fontsize=8)
    ttft.axvspan(0.5, 0.5 + result["args"]["pause_s"], color="0.92", label="paused span")
    ttft.set_yscale("log")
    ttft.set_xlabel("seconds into the window")
    ttft.set_ylabel("TTFT (ms)")
    ttft.legend(fontsize=7)
    fig.suptitle(
        f"Chunked and ordinary requests while the store is paused ({result.get('label') or 'this checkout'})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-store-pause-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "command": portable(shlex.join(["python", "-m", "benchmarks.bench_store_pause", *sys.argv[1:]])),
        "label": args.label,
        "args": {k: portable(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info(),
    }
    result.update(run(args, log_dir))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"ratios (paused / running): {result['ratios']}; wrote {portable(args.out)}")


if __name__ == "__main__":
    main()
