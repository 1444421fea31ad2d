"""`vllm-chunk-cache-eval`: answer quality and warm TTFT of plain reuse and each recovery mode,
against full attention, on your model and samples, through a running patched `vllm serve`.

    vllm-chunk-cache-eval --base-url http://127.0.0.1:8000 --model MODEL [--samples FILE.jsonl]

Per sample: full attention (the prompt's ids as one ordinary prompt), a priming request (the
documents computed into the pool), then each of --modes on the warm documents. Per mode:
agreement with full attention's greedy answer, token F1 against it, contains-the-gold (where
the samples give answers), warm TTFT p50/p90, the share of the prompt computed and the
fallbacks (server counters, at --concurrency 1), each with a 95 % interval; then the cheapest
mode whose agreement's lower bound meets --min-agreement. Results are written after every
sample (--out, a JSON; the PNG beside it) and --resume continues a run. See docs/results/quality.md,
"Choosing a recovery mode for your model".
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from vllm_ascend_chunk import __version__
from vllm_ascend_chunk.eval import client as cl
from vllm_ascend_chunk.eval import measure, report, samples

MODES = ["none", "last:2", "qattn:0.15", "qattn:0.2", "cover:0.7/0.2"]
RESULT_KEYS = ("model", "modes", "guard", "max_tokens", "samples", "samples_digest", "system", "doc_tokens")
"""The settings a resumed run must share with the file it continues."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="vllm-chunk-cache-eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    ap.add_argument("--model", required=True, help="the served model name (the server's /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="default: $VLLM_API_KEY")
    ap.add_argument("--samples", type=Path, help="JSONL of samples (or MuSiQue's JSON); default: built-in")
    ap.add_argument("--builtin", type=int, default=20, metavar="N", help="built-in samples (default 20)")
    ap.add_argument(
        "--docs", type=int, default=None, help="documents per sample (built-in: 5; a file: first K)"
    )
    ap.add_argument("--doc-words", type=int, default=110, help="built-in documents' words (default 110)")
    ap.add_argument("--doc-tokens", type=int, default=None, help="cut each document to this many tokens")
    ap.add_argument("--seed", type=int, default=0, help="built-in set's seed")
    ap.add_argument("--limit", type=int, default=None, help="the first N samples only")
    ap.add_argument("--system", default=samples.SYSTEM_PROMPT, help="system prompt of samples without one")
    ap.add_argument("--no-chat-template", action="store_true", help="plain text prompts, no chat template")
    ap.add_argument(
        "--modes", default=",".join(MODES), help="recovery modes, comma-separated (default %(default)s)"
    )
    ap.add_argument(
        "--guard", default=None, metavar="A,B", help="also the guard: B's answer if A's agrees, else full"
    )
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--min-agreement", type=float, default=0.9, help="for the recommendation (default 0.9)")
    ap.add_argument("--concurrency", type=int, default=1, help="samples in flight (default 1)")
    ap.add_argument(
        "--out", type=Path, default=Path("chunk-cache-eval.json"), help="the JSON (PNG beside it)"
    )
    ap.add_argument("--resume", action="store_true", help="continue --out: measure only the samples it lacks")
    ap.add_argument("--skip-long", action="store_true", help="skip samples longer than the server's context")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.guard is not None:
        pair = [m.strip() for m in args.guard.split(",")]
        if len(pair) != 2 or not all(pair):
            ap.error(f"--guard takes two modes, A,B (got {args.guard!r})")
        args.guard = pair
        args.modes += [m for m in pair if m not in args.modes]  # the guard needs both answers
    if args.concurrency < 1:
        ap.error("--concurrency must be at least 1")
    return args


class Progress:
    """A progress bar with an ETA on a terminal; a line per sample elsewhere."""

    def __init__(self, total: int, done: int, stream=None):
        self.total, self.done, self.stream = total, done, stream or sys.stderr
        self.start, self.at_start = time.monotonic(), done
        self.tty = self.stream.isatty()

    def step(self, note: str = "") -> None:
        self.done += 1
        elapsed = time.monotonic() - self.start
        per = elapsed / max(1, self.done - self.at_start)
        eta = per * (self.total - self.done)
        filled = int(30 * self.done / max(1, self.total))
        bar = "#" * filled + "." * (30 - filled)
        line = (
            f"[{bar}] {self.done}/{self.total} samples, {_clock(elapsed)} elapsed, ETA {_clock(eta)} {note}"
        )
        if self.tty:
            self.stream.write("\r" + line[:160] + ("\n" if self.done == self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def load_samples(args) -> tuple[list[samples.Sample], list[dict], str]:
    if args.samples is None:
        docs = args.docs or 5
        found = samples.generated(args.builtin, docs=docs, doc_words=args.doc_words, seed=args.seed)
        return found, [], f"built-in:{args.builtin}:docs={docs}:words={args.doc_words}:seed={args.seed}"
    if not args.samples.is_file():
        raise cl.EvalError(
            f"no samples file {args.samples}", "pass --samples FILE.jsonl, or omit it for the built-in set"
        )
    found, bad = samples.read(args.samples, args.docs)
    for b in bad:
        print(f"warning: {args.samples}:{b['line']}: {b['error']}: skipped", file=sys.stderr)
    if not found:
        raise cl.EvalError(
            f"no sample in {args.samples} could be read", "one JSON object a line: docs/results/quality.md"
        )
    return found, bad, args.samples.name


def settings_of(args, source: str, digest: str) -> dict:
    return {
        "model": args.model,
        "modes": args.modes,
        "guard": args.guard,
        "max_tokens": args.max_tokens,
        "samples": source,
        "samples_digest": digest,
        "system": args.system,
        "doc_tokens": args.doc_tokens,
        "concurrency": args.concurrency,
        "min_agreement": args.min_agreement,
        "base_url": args.base_url,
    }


def previous_rows(args, settings: dict) -> tuple[list[dict], float]:
    """The rows of the run --resume continues; an error if --out exists without --resume."""
    if not args.out.exists():
        return [], 0.0
    if not args.resume:
        raise cl.EvalError(f"{args.out} exists", "pass --resume to continue it, or another --out")
    import json

    try:
        old = json.loads(args.out.read_text())
    except ValueError as exc:
        raise cl.EvalError(f"{args.out} is not an evaluation's JSON ({exc})", "pass another --out") from None
    differ = [k for k in RESULT_KEYS if old.get("settings", {}).get(k) != settings[k]]
    if differ:
        raise cl.EvalError(
            f"--resume: {args.out} was measured with other settings ({', '.join(differ)})",
            "run with the same settings as that file, or pass another --out",
        )
    return list(old.get("rows", [])), float(old.get("seconds", 0.0))


def connect(args, probe: samples.Sample) -> cl.Server:
    """The server, checked: reachable, serving --model, patched, chunk cache on, --modes known."""
    server = cl.Server(args.base_url, args.model, args.api_key)
    server.check_model()
    builder = measure.Builder(server, not args.no_chat_template, args.system)
    head, tail = builder.parts(None)
    docs = [builder.document(d) for d in probe.documents]
    question = builder.question(probe.question, tail)
    server.check_chunk_cache(head, docs, question)
    ids = [t for part in (head, *docs, question) for t in part]
    spans = {"sys_len": len(head), "chunk_lens": [len(d) for d in docs]}
    for mode in args.modes:  # also the first requests' costs, out of the measured ones
        try:
            server.complete(ids, 1, {"chunk_spans": spans, "chunk_cache_recovery": mode})
        except cl.HTTPStatusError as exc:
            raise cl.EvalError(
                f"the server refused --modes {mode!r} ({cl._message(exc.body)})",
                "pass recovery modes the server knows: none, last[:K], qattn:R[/M], cover:C[/MAX[/MIN]] "
                "(docs/user/prompts.md)",
            ) from None
    return server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except cl.EvalError as exc:
        print(f"vllm-chunk-cache-eval: error: {exc}", file=sys.stderr)
        return 2
    except cl.HTTPStatusError as exc:  # mid-run: the server failed a request
        done = f"; the samples done are in {args.out}: --resume continues" if args.out.exists() else ""
        print(f"vllm-chunk-cache-eval: error: the server failed a request ({exc}){done}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted: {args.out} has the samples done; --resume continues", file=sys.stderr)
        return 130


def run(args) -> int:
    began = time.monotonic()
    found, bad, source = load_samples(args)
    found = found[: args.limit]
    settings = settings_of(args, source, samples.digest(found))
    rows, seconds_before = previous_rows(args, settings)
    probe = samples.Sample("probe", ["Probe document one.", "Probe document two."], "Which probe?")
    server = connect(args, probe)
    builder = measure.Builder(server, not args.no_chat_template, args.system, args.doc_tokens)
    done = {r["sid"] for r in rows}
    todo = [s for s in found if s.sid not in done]
    prompts = {s.sid: builder.prompt(s) for s in todo}
    limit = server.max_model_len
    long = [
        s
        for s in todo
        if limit and max(len(prompts[s.sid].ids), len(prompts[s.sid].prime_ids)) + args.max_tokens > limit
    ]
    if long:
        where = ", ".join(f"{s.sid} ({len(prompts[s.sid].ids)} tokens)" for s in long[:5])
        need = max(len(prompts[s.sid].ids) for s in long) + args.max_tokens
        if not args.skip_long:
            raise cl.EvalError(
                f"{len(long)} samples do not fit the server's max_model_len {limit} with "
                f"--max-tokens {args.max_tokens}: {where}",
                f"serve with --max-model-len {need} or more, cut documents (--doc-tokens, --docs), "
                "or pass --skip-long to measure the others",
            )
        for s in long:
            print(
                f"warning: {s.sid}: {len(prompts[s.sid].ids)} tokens, longer than {limit}: skipped",
                file=sys.stderr,
            )
        todo = [s for s in todo if s not in long]
    skipped = [
        *bad,
        *({"sid": s.sid, "line": s.line, "error": f"longer than max_model_len {limit}"} for s in long),
    ]
    attribute = args.concurrency == 1
    doc = {
        "tool": "vllm-chunk-cache-eval",
        "version": __version__,
        "command": command_line(args.argv),
        "machine": platform.platform(),
        "settings": settings,
        "server": {"max_model_len": limit, "chat_template": builder.chat_template},
        "counters_per_request": attribute,
        "skipped": skipped,
        "rows": rows,
        "seconds_before": seconds_before,
    }
    if not rows and not todo:
        raise cl.EvalError("no sample left to measure", "pass samples that fit the server (see the warnings)")
    if not attribute:
        doc["counters_note"] = (
            f"at --concurrency {args.concurrency} the server's global counters cannot be attributed to one "
            "request: no per-mode computed share or fallbacks; set_counters is the change over the whole run"
        )
        start_counters = server.metrics()
    progress = Progress(len(found) - len(long), len(rows))
    order = {s.sid: i for i, s in enumerate(found)}

    def one(s: samples.Sample) -> dict:
        return measure.measure(server, s, prompts[s.sid], args.modes, args.max_tokens, attribute)

    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        futures = [pool.submit(one, s) for s in todo]
        try:
            for future in as_completed(futures):
                row = future.result()
                rows.append(row)
                rows.sort(key=lambda r: order.get(r["sid"], len(order)))
                finish(doc, args, began)
                progress.step(f"({row['sid']})")
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    if not attribute:
        end = server.settled(start_counters, len(todo) * (2 + len(args.modes)))
        doc["set_counters"] = {
            k: end.get(k, 0.0) - start_counters.get(k, 0.0) for k in (cl.COMPUTED, cl.SELECTED, cl.FALLBACKS)
        }
    finish(doc, args, began, final=True)
    print(report.table(doc["summary"]))
    if not attribute:
        print(doc["counters_note"])
    print(f"recommendation (--min-agreement {args.min_agreement:g}): {doc['recommendation']['text']}")
    if args.guard:
        a, b = args.guard
        print(
            f"guard:{a},{b} is a client policy: {b}'s answer where {a}'s and {b}'s agree, else full attention"
        )
    png = args.out.with_suffix(".png")
    why = report.plot(doc["summary"], png, f"{args.model}: {len(rows)} samples ({source})")
    print(f"wrote {args.out}" + (f" and {png}" if why is None else f" ({why})"))
    return 0


def command_line(argv: list[str]) -> str:
    """The command as run, its API key left out."""
    words, hide = ["vllm-chunk-cache-eval"], False
    for word in argv:
        words.append("KEY" if hide else "--api-key=KEY" if word.startswith("--api-key=") else word)
        hide = word == "--api-key"
    return " ".join(words)


def finish(doc: dict, args, began: float, final: bool = False) -> None:
    """The summary and recommendation of the rows so far, and the JSON written whole."""
    rows = doc["rows"]
    settings = ["full", *args.modes]
    per = {s: [r[s] for r in rows] for s in settings}
    if args.guard:
        name = f"guard:{','.join(args.guard)}"
        per[name] = [measure.guarded(r, *args.guard) for r in rows]
    if rows:
        doc["summary"] = {s: report.summarize(answers) for s, answers in per.items()}
        candidates = [s for s in doc["summary"] if s != "full"]
        doc["recommendation"] = report.recommend(doc["summary"], candidates, args.min_agreement)
    doc["complete"] = final
    doc["seconds"] = round(doc.get("seconds_before", 0) + time.monotonic() - began, 1)
    report.write_json(args.out, doc)
