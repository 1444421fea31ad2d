#!/usr/bin/env python3
"""RAG benchmark: TTFT of chunked prompts through real `vllm serve` processes, three configurations.

    python -m benchmarks.bench_rag                 # the full run (~10 min on a 2-core CPU)
    python -m benchmarks.bench_rag --quick         # a short run (~4 min), same outputs
    python -m benchmarks.bench_rag --long          # 1, 8 and 32 documents of ~1,024 tokens
    python -m benchmarks.bench_rag --long-sets --model .models/dummy-llama3.1-8b --load-format dummy \
        --dtype bfloat16 ...                    # realistic shapes, 8 x 2K, 32 x 1K, 16 x 4K (a GPU)
    python -m benchmarks.bench_rag --concurrency-only --concurrency 16,64 --itl 12 \
        --configs prefix,chunk                  # throughput at 16 and 64 clients, decode cost

One invocation starts `vllm serve` on the benchmark model once per configuration:
  no_cache   VLLM_ENABLE_CHUNK_CACHE=false, --no-enable-prefix-caching
  prefix     VLLM_ENABLE_CHUNK_CACHE=false, --enable-prefix-caching (vLLM's prefix caching alone)
  chunk      VLLM_ENABLE_CHUNK_CACHE=true,  --enable-prefix-caching (chunk cache + prefix caching)
  qattn      the same as chunk, with VLLM_CHUNK_CACHE_RECOVERY=--qattn (only when --configs names it)
and sends every configuration the same sequence of requests (`rag_workload.build_workload`),
one at a time (servers one after the other, or with --parallel-start all started at once and
measured one at a time). Prompts are `SYSTEM # # DOC_1 # # ... # # DOC_n # # QUESTION` with documents of
~512 tokens and a ~32-token question. TTFT is the time to the first streamed token of a
`/v1/completions` request made with the openai client. After each request the server's
Prometheus `/metrics` is read: chunk cache hits and misses (`vllm:chunk_cache_{hits,misses}_total`,
occurrences of documents) and vLLM's prefix cache hits/queries (tokens).

Optional parts of the same run:
  --long             documents of ~1,024 tokens, requests of 1, 8 and 32 of them (the sweep only;
                     configurations no_cache and chunk unless --configs says otherwise);
  --long-sets        the long-context workload of issue 58 (for a GPU): document sets 8 x 2K,
                     32 x 1K and 16 x 4K (--doc-sets), each cold, then warm twice, each warm
                     request followed by its exact-prefix repeat (--floor) and by the recovery
                     variants qattn:0.15 and cover:0.7/0.2 (--recovery-variants: per request, on
                     the chunk cache's server only, with the fallbacks and recomputed tokens its
                     counters show); configurations no_cache, prefix, chunk; then a 16-client
                     Zipf stream of 8-16 documents of ~1K (--concurrency 16): requests/s against
                     prefix caching. Per set: TTFT p50 of each, their ratios, the targets
                     (`rag_sets`); one plot;
  --load-format dummy  a config-only model (scripts/make_dummy_shapes.py): vLLM draws random
                     weights, so TTFT and throughput are the shape's and the generated text is
                     noise (the JSON says so in `weights`; nothing checks answers);
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
import functools
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.rag_itl import run_itl
from benchmarks.rag_phases import Streams, run_config
from benchmarks.rag_plot import plot
from benchmarks.rag_servers import CONFIGS, make_server
from benchmarks.rag_sets import set_table, set_targets
from benchmarks.rag_summary import targets
from benchmarks.rag_tables import print_summary
from harness import rag_workload
from harness.machine import machine_info
from harness.serve_util import MODELS, REPO, VllmServer, env_assignment, portable, start_all


# -- options ----------------------------------------------------------------------------------------------
def parse_docs_per_request(text: str) -> tuple[int, ...]:
    """ "8", "4-8" or "4,6,8"."""
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        return tuple(range(lo, hi + 1))
    return tuple(int(x) for x in text.split(","))


def parse_doc_sets(text: str) -> tuple[tuple[int, int], ...]:
    """ "8x2048,32x1024": (documents, tokens per document) per set."""
    sets = tuple(tuple(int(x) for x in part.split("x")) for part in text.split(","))
    if not all(len(s) == 2 for s in sets):
        raise argparse.ArgumentTypeError(f"{text!r} is not NxT[,NxT...]")
    return sets  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    """The command line (the options whose default depends on others: see `resolve_defaults`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_options(ap)
    _add_workload_options(ap)
    _add_concurrency_and_itl_options(ap)
    ap.add_argument("--seed", type=int, default=0)
    _add_server_options(ap)
    _add_output_options(ap)
    return ap


def _add_run_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", type=Path, default=MODELS / "bench-llama")
    ap.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="dummy: random weights from config.json alone (a shape of scripts/make_dummy_shapes.py; "
        "TTFT only, the answers are noise)",
    )
    ap.add_argument(
        "--configs",
        help="comma-separated subset of: " + ", ".join(CONFIGS) + " (default all; --long: no_cache,chunk)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a short run: fewer requests of every kind (explicit counts still win)",
    )


def _add_workload_options(ap: argparse.ArgumentParser) -> None:
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
    ap.add_argument(
        "--doc-sets",
        type=parse_doc_sets,
        help="sweep points of n documents of ~T tokens each: '8x2048,32x1024' (after --sweep-sizes; "
        "default none, --long-sets 8x2048,32x1024,16x4096)",
    )
    ap.add_argument(
        "--recovery-variants",
        type=lambda text: tuple(m for m in text.split(",") if m),
        help="recovery modes sent per request after each warm sweep request, to the chunk cache's "
        "server only (default none, --long-sets qattn:0.15,cover:0.7/0.2)",
    )
    ap.add_argument(
        "--long-sets",
        action="store_true",
        help="the long-context workload (issue 58): --doc-sets 8x2048,32x1024,16x4096, 2 warm "
        "repeats, --floor, the recovery variants, --concurrency 16 over 8-16 documents of ~1K, "
        "--max-model-len 77824, configurations no_cache,prefix,chunk",
    )
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=2, help="tokens generated per request")


def _add_concurrency_and_itl_options(ap: argparse.ArgumentParser) -> None:
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


def _add_server_options(ap: argparse.ArgumentParser) -> None:
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
        "--recovery",
        default="none",
        help="VLLM_CHUNK_CACHE_RECOVERY of the chunk-cache server (e.g. qattn:0.2; default none)",
    )
    ap.add_argument(
        "--qattn",
        default="qattn:0.2",
        help="VLLM_CHUNK_CACHE_RECOVERY of the `qattn` configuration (target qattn_ratio: its warm "
        "TTFT against the `chunk` server's)",
    )
    ap.add_argument(
        "--parallel-start",
        action="store_true",
        help="start every configuration's server at once, then measure them one at a time with "
        "the others paused (SIGSTOP); on a GPU give each a fixed KV cache "
        "(--server-arg=--kv-cache-memory-bytes=...): vLLM's memory profiling assumes that no "
        "other process changes its memory meanwhile",
    )
    ap.add_argument(
        "--server-arg",
        action="append",
        help="one more argument for every `vllm serve` (repeat; e.g. "
        "--server-arg=--gpu-memory-utilization=0.8)",
    )
    ap.add_argument(
        "--server-env",
        action="append",
        type=env_assignment,
        metavar="NAME=VALUE",
        help="one more environment variable for every `vllm serve` (repeat; e.g. "
        "--server-env=VLLM_ENABLE_V1_MULTIPROCESSING=0: on a CPU, the model worker in the "
        "engine-core process, as on one GPU)",
    )


def _add_output_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--note", default="", help="free text stored in the JSON (e.g. what else ran on the machine)"
    )
    ap.add_argument("--out", type=Path, help="default results/rag/rag_cpu.json (--long: rag_cpu_long.json)")
    ap.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a new temporary directory)")


LONG_SETS = {
    "doc_sets": ((8, 2048), (32, 1024), (16, 4096)),
    "recovery_variants": ("qattn:0.15", "cover:0.7/0.2"),
    "sweep_sizes": (),
    "sweep_repeats": 2,
    "concurrency": (16,),
    "docs_per_request": tuple(range(8, 17)),
    "max_model_len": 77824,  # 16 x ~4,450 tokens (the documents run ~9 % over T) and the rest
    "configs": "no_cache,prefix,chunk",
}
"""The defaults of --long-sets (explicit options still win)."""


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill the options whose default depends on --long / --long-sets / --concurrency-only."""
    if args.long_sets:
        for name, value in LONG_SETS.items():
            if getattr(args, name) in (None, ()):
                setattr(args, name, value)
        args.floor = True
        if args.out is None:
            args.out = REPO / "results" / "rag" / f"rag_{args.model.name}_long_sets.json"
    args.doc_sets = args.doc_sets or ()
    args.recovery_variants = args.recovery_variants or ()
    long = args.long or args.long_sets
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
        args.out = REPO / "results" / "rag" / ("rag_cpu_long.json" if long else "rag_cpu.json")
    if long or args.concurrency_only:  # the sweep alone (long), or nothing but the warmup
        for name in ("cold_requests", "stream_requests", "shuffled_sets"):
            if getattr(args, name) is None:
                setattr(args, name, 0)
    if args.concurrency_only:
        args.sweep_sizes = ()


# -- workload ---------------------------------------------------------------------------------------------
def workload_from_args(args: argparse.Namespace) -> rag_workload.RagWorkload:
    """The sequential requests the options ask for (`rag_workload.build_workload`)."""
    quick = args.quick

    def pick(value: int | None, full: int, short: int) -> int:
        return value if value is not None else short if quick else full

    return rag_workload.build_workload(
        seed=args.seed,
        doc_tokens=args.doc_tokens,
        question_tokens=args.question_tokens,
        sweep_sizes=tuple(args.sweep_sizes),
        sweep_sets=tuple(args.doc_sets),
        sweep_warm_repeats=pick(args.sweep_repeats, 3, 1),
        recovery_variants=tuple(args.recovery_variants),
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


def concurrency_streams(args: argparse.Namespace, workload: rag_workload.RagWorkload) -> Streams:
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


# -- the run ----------------------------------------------------------------------------------------------
def selected_configs(args: argparse.Namespace) -> list[str]:
    """The configurations of --configs; exits on an unknown one or a missing model."""
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    if not (args.model / "config.json").exists():
        raise SystemExit(f"no model at {args.model} (run scripts/setup_env.sh)")
    weights = [p for p in args.model.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".gguf")]
    if not weights and args.load_format != "dummy":
        raise SystemExit(f"no weights in {args.model}: serve its shape with --load-format dummy")
    return configs


DUMMY_WEIGHTS = (
    "random (vllm serve --load-format dummy): TTFT and throughput are the model shape's, the generated "
    "text is noise and nothing here checks it"
)


def new_report(
    args: argparse.Namespace, argv: list[str] | None, workload: rag_workload.RagWorkload, streams: Streams
) -> dict:
    """The JSON report before any server ran: command, machine, settings, the requests."""
    return {
        "command": portable(shlex.join([Path(sys.executable).name, *sys.argv]))
        if argv is None
        else shlex.join(["bench_rag.py", *argv]),
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "note": args.note,
        "weights": DUMMY_WEIGHTS if args.load_format == "dummy" else "the model's own",
        "settings": {k: (portable(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "workload": {
            "description": rag_workload.build_workload.__doc__,
            "system": workload.system,
            "requests": [asdict(r) for r in workload.requests],
            "concurrency_requests": {str(k): [asdict(r) for r in v] for k, v in streams.items()},
        },
        "configs": {},
    }


def _print_sample(config: str, s: dict) -> None:
    hits = "" if s["chunk_hits"] is None else f" hits {s['chunk_hits']:.0f} misses {s['chunk_misses']:.0f}"
    print(
        f"[{config}] {s['index']:>3} {s['phase']:<8} {s['label'] or 'mixed':<5} "
        f"{s['n_docs']} docs {s['prompt_tokens'] or '?':>5} tok  "
        f"TTFT {s['ttft_ms']:8.1f} ms{hits}",
        flush=True,
    )


def log_path_of(config: str, args: argparse.Namespace, log_dir: Path) -> Path:
    """The server log of a configuration."""
    return log_dir / f"{args.out.stem}_{config}.log"


def start_servers(
    configs: list[str], args: argparse.Namespace, log_dir: Path
) -> dict[str, tuple[VllmServer, float | Exception]]:
    """--parallel-start: every configuration's server started at once; per configuration the
    server and its start-up seconds, or the exception that stopped it."""
    print(f"\nstarting {len(configs)} servers at once: {configs}", flush=True)
    servers = [make_server(c, args, log_path_of(c, args, log_dir)) for c in configs]
    outcomes = start_all(servers)
    for config, outcome in zip(configs, outcomes, strict=True):
        said = f"FAILED: {outcome}" if isinstance(outcome, Exception) else f"up in {outcome:.1f} s"
        print(f"[{config}] {said}", flush=True)
    return dict(zip(configs, zip(servers, outcomes, strict=True), strict=True))


def run_one_config(
    config: str,
    workload: rag_workload.RagWorkload,
    args: argparse.Namespace,
    log_dir: Path,
    streams: Streams,
    prestarted: tuple[VllmServer, float | Exception] | None = None,
) -> dict:
    """The configuration's result (on its `prestarted` server, if any); a failure becomes its
    error, so the others' results are kept."""
    log_path = log_path_of(config, args, log_dir)
    try:
        if prestarted is None:
            print(f"\n[{config}] starting vllm serve ({CONFIGS[config]['title']})", flush=True)
        elif isinstance(prestarted[1], Exception):
            raise prestarted[1]
        else:
            print(f"\n[{config}] measuring ({CONFIGS[config]['title']})", flush=True)
        on_sample = functools.partial(_print_sample, config)
        return run_config(config, workload, args, log_path, on_sample, streams, prestarted)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # keep the other configurations' results
        print(f"[{config}] FAILED: {exc}", flush=True)
        return {"title": CONFIGS[config]["title"], "error": repr(exc)}


def run_decode_cost(args: argparse.Namespace, log_dir: Path) -> dict:
    """`run_itl`'s result; a failure becomes its error."""
    print("\n[itl] starting the chunk-off and chunk-on servers side by side", flush=True)
    try:
        return run_itl(args, log_dir)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        print(f"[itl] FAILED: {exc}", flush=True)
        return {"error": repr(exc)}


def finish_report(report: dict, args: argparse.Namespace, started: float, plot_path: Path) -> None:
    """Targets, wall time, load average, mean prompt tokens; write the JSON and the plot."""
    if args.doc_sets:
        report["sets"] = set_table(report["configs"])
    report["targets"] = targets(report["configs"], args.long, report.get("itl"), ttft=not args.doc_sets)
    report["targets"] |= set_targets(report.get("sets", {}))
    report["wall_s"] = time.perf_counter() - started
    with contextlib.suppress(OSError):
        report["machine"]["load_avg_end"] = os.getloadavg()
    samples = [s for r in report["configs"].values() for s in r.get("samples", [])]
    for n in sorted({s["n_docs"] for s in samples}):
        tokens = [s["prompt_tokens"] for s in samples if s["prompt_tokens"] and s["n_docs"] == n]
        report["workload"][f"prompt_tokens_{n}_docs_mean"] = statistics.fmean(tokens) if tokens else None
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if any(r.get("samples") for r in report["configs"].values()) or report.get("itl"):
        weights = ", random weights" if args.load_format == "dummy" else ""
        plot(report, plot_path, f"{args.model.name}{weights}, {report['machine'].get('cpu_model', '')}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 1 if a configuration failed."""
    args = build_parser().parse_args(argv)
    resolve_defaults(args)
    args.served_name = args.model.name
    configs = selected_configs(args)
    plot_path = args.plot or args.out.with_suffix(".png")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_rag-"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    workload = workload_from_args(args)
    streams = concurrency_streams(args, workload) if args.concurrency else {}
    started = time.perf_counter()
    report = new_report(args, argv, workload, streams)
    print(
        f"bench_rag: {len(workload.requests)} requests per configuration, configurations {configs}; "
        f"server logs in {log_dir}",
        flush=True,
    )
    prestarted = start_servers(configs, args, log_dir) if args.parallel_start else {}
    try:
        for config in configs:
            others = [s for c, (s, _) in prestarted.items() if c != config and s.proc is not None]
            with contextlib.ExitStack() as paused:
                for server in others:
                    paused.enter_context(server.paused())
                report["configs"][config] = run_one_config(
                    config, workload, args, log_dir, streams, prestarted.get(config)
                )
        if args.itl:
            report["itl"] = run_decode_cost(args, log_dir)
    finally:
        for server, _ in prestarted.values():
            server.stop()
        finish_report(report, args, started, plot_path)
    print_summary(report)
    print(f"\nwrote {args.out} and {plot_path} in {report['wall_s']:.0f} s")
    return 0 if all("error" not in r for r in report["configs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
