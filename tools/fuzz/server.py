"""Long random fuzz of a real `vllm serve` with the chunk cache on (small pool, short context).

    .venv/bin/python -m tools.fuzz.server                      # 2,000 requests, seed 0
    .venv/bin/python -m tools.fuzz.server --seed 3 --requests 500 --concurrency 16
    .venv/bin/python -m tools.fuzz.server --seed 0 --only 137  # one case again
    .venv/bin/python -m tools.fuzz.server --no-prompt-logprobs --skip seed  # past known bugs

The server: the tiny Llama, `--max-model-len 1024`, a 48-page (768-token) chunk pool, chunked
prefill in 256-token steps, `--scheduling-policy priority` (with `fcfs` vLLM ignores priorities).
Requests: random chunked prompts (`SYSTEM # # DOC_1 # # ... # # QUESTION`, parts drawn from a
small corpus so documents repeat and evict each other, random delimiters and whitespace, empty
parts, unusual Unicode, sizes around the pool and max_model_len), plain prompts, completions and
chat, with random options (echo, logprobs, prompt_logprobs, n, best_of, beam search, stop, seed,
temperature, min/max tokens, truncate_prompt_tokens, response_format, priority) and a recovery
mode (`--recovery`: none, last:K, qattn:R, or the server's), streamed or not, some streams closed
early. Case i is a function of (seed, i) alone: `--only i` re-sends it; `--no-prompt-logprobs`,
`--skip` and `--recovery` drop options without changing anything else.

`python -m tools.fuzz.soak` runs the same fuzz against a server with the host tier and a real
Mooncake Store, under store faults, in phases (TP=1, TP=2), for 10,000 requests.

Checks (FAILURE_KINDS): every answer is a 200 or a 4xx with a message (never a 5xx, a client
timeout, a dropped connection), a stream's error event has a 4xx code, `/health` answers after
every request on the request's own keep-alive connection; every deterministic 200 (temperature
0, or a seed) gives the token ids the same request gives alone on the idle server afterwards;
with nothing in flight, no request is running or waiting and no chunk cache entry is pinned.
A dead server is restarted (up to `--max-deaths` times) so that the run goes on past it.
Writes a JSON report (`--out`), prints a summary with a reproduction per failure, exits 1 on any
failure not of an `--ignore`d kind.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from tools.fuzz.cases import FuzzSettings, make_cases
from tools.fuzz.report import FAILURE_KINDS, summary
from tools.fuzz.run import Target, fuzz, server_factory
from vllm_ascend_chunk.config.recovery_modes import RECOVERY_ACCEPTED, recovery_of

REPO = Path(__file__).resolve().parents[2]


def build_parser() -> argparse.ArgumentParser:
    """The command line; every default is `FuzzSettings`'s."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_options(p)
    _add_io_options(p)
    return p


def add_case_options(p: argparse.ArgumentParser) -> None:
    """The options that make `FuzzSettings` (`settings_from`; also `tools/fuzz/soak.py`'s)."""
    defaults = FuzzSettings()
    _add_run_options(p, defaults)
    _add_filter_options(p, defaults)


def _add_run_options(p: argparse.ArgumentParser, d: FuzzSettings) -> None:
    """How many cases, how fast, and the server's shape."""
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds a request may take")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--pool-pages", type=int, default=d.pool_pages, help="chunk pool size, 16-token pages")
    p.add_argument(
        "--scheduling-policy",
        choices=["priority", "fcfs"],
        default=d.scheduling_policy,
        help="the server's; with fcfs, vLLM 0.23 ignores the requests' priority",
    )


def _add_filter_options(p: argparse.ArgumentParser, d: FuzzSettings) -> None:
    """What is left out of the cases, which failures count, which cases run."""
    p.add_argument(
        "--no-prompt-logprobs",
        action="store_true",
        help="ask for no prompt logprobs: no prompt_logprobs, no chat echo, no completion echo with logprobs",
    )
    p.add_argument(
        "--ignore",
        type=lambda s: tuple(s.split(",")),
        default=(),
        help="failure kinds (comma-separated) listed but not failing the run: " + ", ".join(FAILURE_KINDS),
    )
    p.add_argument(
        "--skip",
        type=lambda s: tuple(s.split(",")),
        default=(),
        help="request options (comma-separated body keys, e.g. seed) never sent; the "
        "cases are otherwise the same",
    )
    p.add_argument(
        "--recovery",
        type=lambda s: tuple(s.split(",")),
        default=d.recovery,
        help="recovery modes (comma-separated) each case draws one of; `default` sends none "
        f"(default: {','.join(d.recovery)})",
    )
    p.add_argument("--max-deaths", type=int, default=d.max_deaths, help="server restarts before giving up")
    p.add_argument(
        "--only",
        type=lambda s: [int(i) for i in s.split(",")],
        default=None,
        help="only these case indices (comma-separated), to reproduce a failure",
    )


def _add_io_options(p: argparse.ArgumentParser) -> None:
    """Which server, where the log and the report go."""
    p.add_argument("--url", default=None, help="fuzz this running server instead of starting one")
    p.add_argument("--model", type=Path, default=REPO / ".models" / "tiny-llama")
    p.add_argument("--log", type=Path, default=None, help="server log (default: a temporary file)")
    p.add_argument("--out", type=Path, default=Path("fuzz_server.json"), help="JSON report")
    p.add_argument("--print-cases", action="store_true", help="print the cases' JSON and exit")


def settings_from(p: argparse.ArgumentParser, args: argparse.Namespace) -> FuzzSettings:
    """The `FuzzSettings` of `add_case_options`' options; exits on an unknown `--ignore` kind or
    recovery mode."""
    if unknown := set(args.ignore) - set(FAILURE_KINDS):
        p.error(f"--ignore: unknown failure kinds {sorted(unknown)}")
    if bad := [m for m in args.recovery if m != "default" and recovery_of(m) is None]:
        p.error(f"--recovery: not recovery modes: {bad} ({RECOVERY_ACCEPTED}, or default)")
    return FuzzSettings(
        seed=args.seed,
        requests=args.requests,
        concurrency=args.concurrency,
        timeout=args.timeout,
        max_model_len=args.max_model_len,
        pool_pages=args.pool_pages,
        scheduling_policy=args.scheduling_policy,
        prompt_logprobs=not args.no_prompt_logprobs,
        max_deaths=args.max_deaths,
        ignore=args.ignore,
        skip=args.skip,
        only=args.only,
        recovery=args.recovery,
    )


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, FuzzSettings]:
    """The options and the `FuzzSettings` they give."""
    p = build_parser()
    args = p.parse_args(argv)
    return args, settings_from(p, args)


def main(argv: list[str] | None = None) -> int:
    """Run the fuzz (or print its cases); 1 on a failure that counts."""
    args, settings = parse_args(argv)
    if args.print_cases:
        for case in make_cases(settings):
            print(json.dumps(asdict(case), ensure_ascii=False))
        return 0
    start = None if args.url else server_factory(args.model, settings, args.log)
    with Target(args.url, start) as target:
        if target.server is not None:
            print(f"server log: {target.server.log_path}", flush=True)
        report = fuzz(target, settings)
    args.out.write_text(json.dumps(report.to_json(), indent=1, ensure_ascii=False))
    print(summary(report))
    print(f"report: {args.out}")
    return 1 if report.failing() else 0


if __name__ == "__main__":
    sys.exit(main())
