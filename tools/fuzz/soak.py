"""The long fuzz with every tier, every recovery mode and store faults: 10,000 requests.

    python -m tools.fuzz.soak --skip seed --out results/fuzz/fuzz_10k_cpu.json   # ~10,000 requests
    python -m tools.fuzz.soak --skip seed --requests 300 --out /tmp/soak.json  # a short run

The fuzz's cases (`tools/fuzz/server.py`, the same options, each case drawing a recovery mode)
against a `vllm serve` with its small chunk pool, a host tier (`--host-pages`) and a real
Mooncake Store started here (master and store process on loopback, objects in parts of
`--part-kb`, signed with a secret made for the run unless `--no-secret`), in phases: phase A at
TP=1 on cases 0 .. n-1, phase B at TP=2 (`--tp2-fraction` of `--requests`) on the cases after
them, one server each, both on the same store. In each phase's concurrent pass, store faults at
fixed fractions of its requests (`--faults`, `harness/store_faults.py`): the master killed and
started again, the store paused, a part of about half of the objects removed, a slow store.

Checked per phase, and written to one JSON (`--out`, after every phase) with a plot of the
servers' resident memory next to it (same name, `.png`):
- the fuzz's checks: no 5xx, hang or dropped connection, no server death, every deterministic
  answer equal to the same request's alone on the idle server, nothing in flight or pinned once
  idle (`tools/fuzz/run.py`);
- counters that add up, documents looked up, no leaked pins or pages, the remote tier up again
  (`tools/fuzz/audit.py`);
- resident memory of the server's process tree (sampled every `--rss-interval-s`) flat over the
  last half of the phase: least-squares growth under `--rss-threshold` % per 1,000 requests.
Exit status 1 unless every check passes. A failing case is re-sent alone, on a plain fuzz
server, with the command in its failure (`python -m tools.fuzz.server --seed S --only I`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from harness.machine import machine_info
from harness.mooncake_store import STORE_BYTES, MooncakeProcs
from harness.serve_util import MODELS, portable
from harness.store_faults import FAULTS, FaultInjector, FaultSettings, fault_plan
from tools.fuzz.audit import RssSampler, audit, rss_trend
from tools.fuzz.cases import KV_BYTES_PER_TOKEN, PAGE_TOKENS, FuzzSettings
from tools.fuzz.report import Report, summary
from tools.fuzz.run import Target, fuzz, log, server_factory

DEFAULT_FAULTS = "master=0.2,pause=0.35,parts=0.5,slow=0.65"
TP2 = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""vLLM's CPU backend binds one core per rank."""


@dataclass(frozen=True)
class Phase:
    """`requests` cases from `first`, on a server of `tp` ranks."""

    name: str
    tp: int
    first: int
    requests: int


def phases(requests: int, tp2_fraction: float) -> list[Phase]:
    """Phase A at TP=1, then phase B at TP=2 on the next cases (none if `tp2_fraction` is 0)."""
    b = round(requests * tp2_fraction)
    out = [Phase("A", 1, 0, requests - b), Phase("B", 2, requests - b, b)]
    return [p for p in out if p.requests]


def build_parser() -> argparse.ArgumentParser:
    from tools.fuzz.server import add_case_options

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_options(p)
    p.set_defaults(requests=10_000)
    p.add_argument("--tp2-fraction", type=float, default=0.2, help="share of the requests at TP=2")
    p.add_argument(
        "--host-pages", type=int, default=None, help="host tier (16-token pages; default: the pool's)"
    )
    p.add_argument("--part-kb", type=float, default=24.0, help="remote object part size (KiB)")
    p.add_argument("--store-mb", type=int, default=STORE_BYTES >> 20, help="the store process's memory (MiB)")
    p.add_argument("--remote-timeout-s", type=float, default=2.0)
    p.add_argument("--no-secret", action="store_true", help="objects unsigned (the store is trusted)")
    p.add_argument(
        "--faults",
        default=DEFAULT_FAULTS,
        help="KIND=FRACTION,... of each phase's requests (none: no faults); kinds: "
        + "; ".join(f"{k}: {v}" for k, v in FAULTS.items()),
    )
    p.add_argument("--pause-s", type=float, default=FaultSettings.pause_s)
    p.add_argument("--slow-s", type=float, default=FaultSettings.slow_s)
    p.add_argument("--rss-interval-s", type=float, default=2.0)
    p.add_argument("--rss-threshold", type=float, default=1.0, help="%% of RSS per 1,000 requests")
    p.add_argument("--model", type=Path, default=MODELS / "tiny-llama")
    p.add_argument("--log-dir", type=Path, default=None, help="server and store logs (default: temporary)")
    p.add_argument("--out", type=Path, default=Path("results/fuzz/fuzz_10k_cpu.json"))
    return p


def parse_faults(text: str) -> dict[str, float]:
    if text in ("", "none"):
        return {}
    return {kind: float(frac) for kind, _, frac in (item.partition("=") for item in text.split(","))}


def tier_env(args: argparse.Namespace, store: MooncakeProcs, tp: int, secret: str) -> dict[str, str]:
    """The chunk cache's tiers, sized for `tp` ranks (each keeps 1/tp of a token's K/V)."""
    page_gb = PAGE_TOKENS * KV_BYTES_PER_TOKEN / tp / 2**30
    host_pages = args.host_pages if args.host_pages is not None else args.pool_pages
    return {
        "VLLM_CHUNK_CACHE_SIZE_GB": f"{args.pool_pages * page_gb:.12g}",
        "VLLM_CHUNK_CACHE_HOST_GB": f"{host_pages * page_gb:.12g}",
        **store.server_env(args.remote_timeout_s, args.part_kb / 1024, secret),
        "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache, for the leak check
        **(TP2_ENV if tp == 2 else {}),
    }


def run_phase(args, settings: FuzzSettings, phase: Phase, store: MooncakeProcs, secret: str) -> dict:
    """One phase: its server, the fuzz under faults and the RSS sampler, the audit."""
    settings = replace(settings, first=phase.first, requests=phase.requests)
    env = tier_env(args, store, phase.tp, secret)
    start = server_factory(
        args.model, settings, args.log_dir / f"server-{phase.name}.log", env, TP2 if phase.tp == 2 else []
    )
    plan = fault_plan(phase.requests, parse_faults(args.faults))
    fault_settings = FaultSettings(pause_s=args.pause_s, slow_s=args.slow_s)
    watch: dict = {}
    began = time.monotonic()
    with Target(start=start) as target:
        log(f"phase {phase.name}: TP={phase.tp}, cases {phase.first}..{phase.first + phase.requests - 1}")

        @contextlib.contextmanager
        def during(report: Report):
            def answered() -> int:
                return report.counts["requests"]

            injector = FaultInjector(store, plan, answered, fault_settings, log=log)
            sampler = RssSampler(target, answered, args.rss_interval_s)
            watch.update(faults=injector, rss=sampler)
            with injector, sampler:
                yield

        report = fuzz(target, settings, during)
        checks = audit(report, target.url, settings.seed)
    trend = rss_trend(watch["rss"].samples, phase.requests, args.rss_threshold)
    print(summary(report), flush=True)
    return {
        "phase": asdict(phase),
        "seconds": round(time.monotonic() - began),
        "faults": watch["faults"].records,
        "faults_skipped": watch["faults"].skipped,
        "fuzz": report.to_json(),
        "audit": checks,
        "rss": {**asdict(trend), "flat": trend.flat},
        "rss_samples_mib": [  # seconds, requests answered, server tree, API server process
            [t, n, round(rss / 2**20, 1), round(api / 2**20, 1)] for t, n, rss, api in watch["rss"].samples
        ],
    }


def passed(results: list[dict]) -> dict[str, bool]:
    """The run's verdicts, over every phase."""

    def total(kind: str) -> int:
        return sum(r["fuzz"]["counts"][f"failure:{kind}"] for r in results)

    return {
        "no_server_death": total("server-death") == 0
        and all(r["fuzz"]["counts"]["server restarts"] == 0 for r in results),
        "no_wrong_answer": total("mismatch-greedy") + total("mismatch-seeded") == 0
        and all(r["fuzz"]["counts"].get("reference checks", 0) > 0 for r in results),
        "no_leaked_pins_or_pages": total("leaked-pins") + total("in-flight") + total("leaked-pages") == 0,
        "counters_add_up": total("counters") == 0,
        "remote_tier_up_at_the_end": all(r["audit"]["remote_up"] for r in results) or not results,
        "rss_flat_last_half": all(r["rss"]["flat"] for r in results),
        "every_fault_injected": all(not r["faults_skipped"] for r in results),
        "no_failure": all(r["fuzz"]["failing"] == 0 for r in results),
    }


def plot(results: list[dict], path: Path) -> None:
    """RSS over requests answered, a panel per phase: the samples, the last half's fit, faults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        phase, samples = r["phase"], np.array(r["rss_samples_mib"] or [[0, 0, 0, 0]], dtype=float)
        ax.plot(samples[:, 1], samples[:, 2], ".", ms=3, label="server tree RSS")
        last = samples[samples[:, 1] >= phase["requests"] / 2]
        if len(last) >= 3 and len(set(last[:, 1])) > 1:
            fit = np.polyfit(last[:, 1], last[:, 2], 1)
            ax.plot(last[:, 1], np.polyval(fit, last[:, 1]), "-", label="last half, least squares")
        for f in r["faults"]:
            ax.axvline(f["answered"], color="grey", ls="--", lw=0.8)
            ax.annotate(f["kind"], (f["answered"], ax.get_ylim()[1]), fontsize=7, rotation=90, va="top")
        slope = r["rss"]["slope_pct_per_1000"]
        ax.set_title(f"phase {phase['name']}, TP={phase['tp']}: {slope} % / 1,000 requests", fontsize=9)
        ax.set_xlabel("requests answered")
        ax.set_ylabel("RSS (MiB)")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(args, settings: FuzzSettings, results: list[dict], wall: float, store_info: dict) -> dict:
    report = {
        "command": portable(" ".join([Path(sys.executable).name, "-m", "tools.fuzz.soak", *sys.argv[1:]])),
        "settings": {
            **{k: portable(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "fuzz": asdict(settings),
        },
        "machine": machine_info(),
        "wall_s": round(wall),
        "store": store_info,
        "phases": results,
        "pass": passed(results),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    if results:
        plot(results, args.out.with_suffix(".png"))
    return report


def main(argv: list[str] | None = None) -> int:
    from tools.fuzz.server import settings_from

    p = build_parser()
    args = p.parse_args(argv)
    settings = settings_from(p, args)
    if args.only is not None:
        p.error("--only: re-send a case with python -m tools.fuzz.server --seed S --only I")
    fault_plan(1, parse_faults(args.faults))  # unknown kinds fail here
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="fuzz-soak-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    secret = "" if args.no_secret else secrets.token_hex(32)
    log(f"logs in {args.log_dir}")
    store = MooncakeProcs(args.log_dir, store_bytes=args.store_mb << 20).start()
    store_info = {"bytes": store.store_bytes, "signed": bool(secret), "part_kb": args.part_kb}
    results: list[dict] = []
    began = time.monotonic()
    try:
        for phase in phases(args.requests, args.tp2_fraction):
            results.append(run_phase(args, settings, phase, store, secret))
            report = write(args, settings, results, time.monotonic() - began, store_info)
    finally:
        store.stop()
    report = write(args, settings, results, time.monotonic() - began, store_info)
    print(json.dumps({"wall_s": report["wall_s"], "pass": report["pass"]}, indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0 if all(report["pass"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
