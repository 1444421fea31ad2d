#!/usr/bin/env python3
"""Warm TTFT and ITL of this checkout against another checkout of the project (issue 54: a
restructuring must cost no speed): a chunk-cache server (`chunk`: the chunk cache and prefix
caching) from each, on the same model, sent the same prompts, measured in turns.

    git worktree add ../baseline 6d8e664 && ../baseline/scripts/setup_env.sh
    python -m benchmarks.bench_baseline --baseline ../baseline --out results/rag/baseline_cpu.json  # ~6 min

Both servers run from the start; while one is measured the other is paused (SIGSTOP), and the
order alternates by round (ABBA), so drift in the machine falls on both. Per round and server:
one warm chunked request (its documents cached by an unmeasured first send, a new question each
round) for TTFT, and one streamed decode of `--decode-tokens` tokens of each kind of prompt
(chunked, and the same documents as one ordinary prompt) for the gaps between tokens, timed by
the client. Reported per server: TTFT p50 and mean, ITL p50 and p99; the ratios this/baseline
with a 95% bootstrap interval (rounds resampled, the same rounds for both servers: the gaps of
one request are not independent samples); a ratio is within noise when its interval holds 1.

Outputs: `--out` JSON (samples, summaries, ratios, both commits, the command, the machine) and
a PNG beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.rag_servers import ttft_request
from benchmarks.rag_summary import percentile
from harness import rag_workload
from harness.machine import git_state, machine_info
from harness.serve_util import MODELS, REPO, VllmServer, openai_client, portable, start_all, tiny_serve_args

NAME = "tiny-rag"
SERVERS = ("this", "baseline")
KINDS = ("chunked", "ordinary")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--baseline", type=Path, required=True, help="the other checkout, set up by its setup_env.sh"
    )
    ap.add_argument("--model", type=Path, default=MODELS / "bench-llama")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--docs", type=int, default=4, help="documents per prompt")
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens streamed per ITL request")
    ap.add_argument("--bootstrap", type=int, default=2000, help="resamples of each ratio's interval")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "rag" / "baseline_cpu.json")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a new temporary directory)")
    args = ap.parse_args(argv)
    if not (args.baseline / ".venv" / "bin" / "python").is_file():
        ap.error(f"--baseline {args.baseline}: no .venv; run its scripts/setup_env.sh first")
    return args


def commit(checkout: Path) -> str:
    """The checkout's short commit (with `+dirty` when its tracked files changed)."""
    state = git_state(checkout)
    return state["commit"][:7] + ("+dirty" if state["dirty"] else "")


def make_server(args: argparse.Namespace, log_dir: Path, which: str) -> VllmServer:
    env = {
        "VLLM_ENABLE_CHUNK_CACHE": "true",
        "VLLM_CHUNK_CACHE_RECOVERY": "none",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CHUNK_CACHE_SIZE_GB": "0.5",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        "PYTHONPATH": None,  # each server imports its own checkout's package
    }
    cli = [*tiny_serve_args(NAME), "--enable-prefix-caching"]
    checkout = args.baseline.resolve() if which == "baseline" else None
    return VllmServer(
        args.model.resolve(), cli, env=env, log_path=log_dir / f"{which}.log", checkout=checkout
    )


def gaps_ms(client, prompt: str, tokens: int) -> list[float]:
    """The client-side gaps between the streamed tokens of one greedy decode of `tokens` tokens."""
    stamps = []
    stream = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]


Rounds = list[list[float]]
"""One figure's samples, by round."""


def measure(servers: dict[str, VllmServer], args: argparse.Namespace) -> dict[str, dict[str, Rounds]]:
    """Per server: the warm TTFTs and each kind's token gaps, by round (`--rounds`, ABBA order)."""
    w = rag_workload.RagWorkload(doc_tokens=args.doc_tokens)
    docs = [w.doc(rag_workload.STREAM_SEEDS + 700 + i) for i in range(args.docs)]
    clients = {k: openai_client(s.url, timeout=300) for k, s in servers.items()}
    samples = {k: {"ttft_ms": [], "itl_chunked_ms": [], "itl_ordinary_ms": []} for k in servers}
    for which in servers:  # the documents in each server's pool (and its compiled shapes warm)
        with servers[_other(which)].paused():
            for r in range(2):
                ttft_request(clients[which], NAME, rag_workload.chunked(w.system, docs, f"Warm {r}?"), 2)
    for r in range(args.rounds):
        q = rag_workload.question(4_000_000 + r, 32)
        prompts = {
            "chunked": rag_workload.chunked(w.system, docs, q),
            "ordinary": "\n\n".join([w.system, *docs, q]),
        }
        for which in SERVERS if r % 4 in (0, 3) else SERVERS[::-1]:
            with servers[_other(which)].paused():
                got = samples[which]
                ttft = ttft_request(clients[which], NAME, prompts["chunked"], 2)["ttft_s"]
                got["ttft_ms"].append([ttft * 1e3])
                for kind in KINDS:
                    got[f"itl_{kind}_ms"].append(gaps_ms(clients[which], prompts[kind], args.decode_tokens))
        if r % 10 == 9:
            print(f"round {r + 1}/{args.rounds}: " + _brief(samples), flush=True)
    return samples


def _other(which: str) -> str:
    return SERVERS[1 - SERVERS.index(which)]


FIGURE_OF = {
    "ttft_p50_ms": ("ttft_ms", lambda xs: percentile(xs, 50)),
    "ttft_mean_ms": ("ttft_ms", lambda xs: sum(xs) / len(xs)),
    "itl_chunked_p50_ms": ("itl_chunked_ms", lambda xs: percentile(xs, 50)),
    "itl_chunked_p99_ms": ("itl_chunked_ms", lambda xs: percentile(xs, 99)),
    "itl_ordinary_p50_ms": ("itl_ordinary_ms", lambda xs: percentile(xs, 50)),
    "itl_ordinary_p99_ms": ("itl_ordinary_ms", lambda xs: percentile(xs, 99)),
}


def _flat(rounds: Rounds, picked: list[int] | None = None) -> list[float]:
    return [x for i in (range(len(rounds)) if picked is None else picked) for x in rounds[i]]


def figures(samples: dict[str, Rounds]) -> dict[str, float]:
    return {name: fn(_flat(samples[key])) for name, (key, fn) in FIGURE_OF.items()}


def ratios(samples: dict[str, dict[str, Rounds]], resamples: int, seed: int = 0) -> dict[str, dict]:
    """Per figure: this/baseline, its 95% bootstrap interval, and whether the interval holds 1."""
    rng = random.Random(seed)
    out = {}
    for name, (key, fn) in FIGURE_OF.items():
        a, b = samples["this"][key], samples["baseline"][key]
        boot = []
        for _ in range(resamples):
            picked = rng.choices(range(len(a)), k=len(a))
            boot.append(fn(_flat(a, picked)) / fn(_flat(b, picked)))
        lo, hi = percentile(boot, 2.5), percentile(boot, 97.5)
        out[name] = {"ratio": fn(_flat(a)) / fn(_flat(b)), "ci95": [lo, hi], "within_noise": lo <= 1.0 <= hi}
    return out


def _brief(samples: dict[str, dict[str, Rounds]]) -> str:
    return "; ".join(
        f"{k}: TTFT p50 {percentile(_flat(s['ttft_ms']), 50):.1f} ms, "
        f"ITL p50 {percentile(_flat(s['itl_chunked_ms']), 50):.2f} ms"
        for k, s in samples.items()
        if s["ttft_ms"]
    )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["ratios"])
    r = [result["ratios"][n]["ratio"] for n in names]
    lo = [x - result["ratios"][n]["ci95"][0] for n, x in zip(names, r, strict=True)]
    hi = [result["ratios"][n]["ci95"][1] - x for n, x in zip(names, r, strict=True)]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.errorbar(range(len(names)), r, yerr=[lo, hi], fmt="o", capsize=4)
    ax.axhline(1.0, color="0.6", lw=1)
    ax.set_xticks(range(len(names)), [n.removesuffix("_ms") for n in names], rotation=20, fontsize=8)
    ax.set_ylabel(f"{result['commits']['this']} / {result['commits']['baseline']} (95% interval)")
    ax.set_title("Warm TTFT and ITL: this checkout over the baseline, chunk-cache servers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "command": portable(shlex.join(["python", "-m", "benchmarks.bench_baseline", *sys.argv[1:]])),
        "commits": {"this": commit(REPO), "baseline": commit(args.baseline)},
        "args": {k: portable(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info(),
    }
    servers = {which: make_server(args, log_dir, which) for which in SERVERS}
    try:
        started = start_all(list(servers.values()))
        for which, got in zip(SERVERS, started, strict=True):
            if isinstance(got, Exception):
                raise SystemExit(f"the {which} server did not start: {got}")
        result["server_command"] = portable(shlex.join(servers["this"].command[1:]))
        samples = measure(servers, args)
    finally:
        for server in servers.values():
            server.stop()
    result["figures"] = {k: figures(s) for k, s in samples.items()}
    result["ratios"] = ratios(samples, args.bootstrap)
    result["samples"] = samples
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for name, r in result["ratios"].items():
        print(
            f"{name}: {r['ratio']:.3f} (95% {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f})"
            f"{'' if r['within_noise'] else '  NOT within noise'}"
        )
    print(f"wrote {portable(args.out)}")


if __name__ == "__main__":
    main()
