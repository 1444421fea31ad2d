"""The fuzz's report: the kinds of failure, the checks of each answer that record them, the
counts, and the summary printed at the end with a reproduction per failure.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from tools.fuzz.cases import RECOVERY_MODES, Case, FuzzSettings
from tools.fuzz.client import Outcome


@dataclass
class Failure:
    """One failure: its kind (FAILURE_KINDS), what happened, the case, the command re-sending it."""

    kind: str
    detail: str
    case: dict | None = None
    repro: str = ""


FAILURE_KINDS = {
    "5xx": "an HTTP 5xx answer",
    "4xx-no-message": "a 4xx answer without an error message",
    "timeout": "no complete answer within --timeout (a hang)",
    "connection": "the connection dropped before the answer",
    "stream-error": "a stream's error event with a code other than 4xx, or no message",
    "vllm-known": "a 5xx (or the closed connection after it) of a request whose options hit a "
    "failure of vLLM itself, with the chunk cache off too (KNOWN_VLLM_FAILURES, docs/results/fuzzing.md)",
    "closed-connection": "the server closed the keep-alive connection after answering (the next "
    "request on it fails)",
    "server-death": "/health failed after a request (the server is restarted)",
    "mismatch-greedy": "a temperature-0 answer differs from the same request's answer alone",
    "mismatch-seeded": "a seeded answer differs from the same request's answer alone",
    "in-flight": "requests still running or waiting with no client left",
    "leaked-pins": "chunk cache entries pinned with nothing in flight",
    "leaked-pages": "pool or host-tier entries or pages left after a cache reset with nothing in "
    "flight (tools/fuzz/soak.py)",
    "counters": "chunk cache counters that do not add up (tools/fuzz/soak.py)",
}


def repro_command(settings: dict, index: int) -> str:
    """The command that sends case `index` again (with the options that shape the cases)."""
    args = [f"--seed {settings['seed']}", f"--only {index}"]
    if not settings["prompt_logprobs"]:
        args.append("--no-prompt-logprobs")
    if settings["skip"]:
        args.append("--skip " + ",".join(settings["skip"]))
    if settings["max_model_len"] != FuzzSettings.max_model_len:
        args.append(f"--max-model-len {settings['max_model_len']}")
    if tuple(settings.get("recovery", RECOVERY_MODES)) != RECOVERY_MODES:
        args.append("--recovery " + ",".join(settings["recovery"]))
    return "python -m tools.fuzz.server " + " ".join(args)


@dataclass
class Report:
    """Counts by status, option and 4xx message, and the failures, of one run."""

    settings: dict
    counts: Counter = field(default_factory=Counter)
    by_status: Counter = field(default_factory=Counter)
    by_option: Counter = field(default_factory=Counter)
    messages_4xx: Counter = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts.update({f"failure:{kind}": 0 for kind in FAILURE_KINDS} | {"server deaths": 0})

    def fail(self, kind: str, detail: str, case: Case | None = None) -> None:
        """Record a failure of `kind` (with the command that re-sends `case`)."""
        assert kind in FAILURE_KINDS, kind
        self.counts[f"failure:{kind}"] += 1
        repro = repro_command(self.settings, case.index) if case else ""
        self.failures.append(Failure(kind, detail, asdict(case) if case else None, repro))

    def failing(self) -> list[Failure]:
        """The failures that count (not of a kind in `settings["ignore"]`)."""
        return [f for f in self.failures if f.kind not in self.settings.get("ignore", ())]

    def to_json(self) -> dict:
        """The report as written to `--out`."""
        return {
            "settings": self.settings,
            "counts": dict(self.counts),
            "by_status": dict(self.by_status),
            "by_option": dict(sorted(self.by_option.items())),
            "messages_4xx": dict(self.messages_4xx.most_common()),
            "failing": len(self.failing()),
            "failures": [asdict(f) for f in self.failures],
        }


KNOWN_VLLM_FAILURES = {
    "structured output past the grammar's end": lambda body: bool(
        body.get("response_format") and (body.get("ignore_eos") or body.get("min_tokens"))
    ),
    "beam search with echo and logprobs": lambda body: bool(
        body.get("use_beam_search") and body.get("echo") and body.get("logprobs") is not None
    ),
}
"""Failures of vLLM 0.23 itself that a 5xx of a request with these options is (docs/results/fuzzing.md:
each reproduced on a server with the chunk cache off)."""


def server_error_kind(case: Case) -> tuple[str, str]:
    """The failure kind of a 5xx answer to `case` and what to prefix its detail with:
    `vllm-known` and the failure's name where its options hit one of KNOWN_VLLM_FAILURES."""
    for name, hits in KNOWN_VLLM_FAILURES.items():
        if hits(case.body):
            return "vllm-known", f"{name}: "
    return "5xx", ""


def short(message: str) -> str:
    """A message without its numbers, to count messages of the same kind together."""
    return "".join("#" if c.isdigit() else c for c in message)[:160]


def check_outcome(report: Report, case: Case, out: Outcome) -> None:
    """Count the outcome; record it as a failure unless it is a 200 or a 4xx with a message."""
    report.counts["requests"] += 1
    report.by_status[str(out.status or out.kind)] += 1
    report.by_option.update(case.options())
    if out.kind:
        report.fail(out.kind, f"after {out.seconds:.1f} s: {out.message}", case)
    elif out.status is not None and out.status >= 500:
        kind, name = server_error_kind(case)
        report.fail(kind, f"{name}HTTP {out.status}: {out.message}", case)
    elif out.status != 200 and not out.message:
        report.fail("4xx-no-message", f"HTTP {out.status}", case)
    elif out.stream_error_code is not None:
        report.by_status[f"stream error {out.stream_error_code}"] += 1
        if not 400 <= out.stream_error_code < 500 or not out.message:
            report.fail("stream-error", f"code {out.stream_error_code}: {out.message}", case)
    if 400 <= (out.stream_error_code or out.status or 0) < 500:
        report.messages_4xx[short(out.message)] += 1


def clean(out: Outcome) -> bool:
    """A 200 answered in full."""
    return out.status == 200 and not out.kind and out.stream_error_code is None


def check_reference(report: Report, case: Case, got: Outcome, alone: Outcome) -> None:
    """The same deterministic request alone must answer the same status and token ids."""
    report.counts["reference checks"] += 1
    if (alone.status, alone.stream_error_code, alone.token_ids) != (
        got.status,
        got.stream_error_code,
        got.token_ids,
    ):
        detail = (
            f"under load: HTTP {got.status} {got.stream_error_code} {got.token_ids} {got.message!r}; "
            f"alone: HTTP {alone.status} {alone.stream_error_code} {alone.token_ids} {alone.message!r}"
        )
        report.fail(
            "mismatch-greedy" if case.body.get("temperature") == 0 else "mismatch-seeded", detail, case
        )


def summary(report: Report) -> str:
    """The counts, the 4xx messages and the failures by kind, with reproductions, as text."""
    lines = [f"{k}: {v}" for k, v in sorted(report.counts.items())]
    lines.append("by status: " + ", ".join(f"{k}={v}" for k, v in sorted(report.by_status.items())))
    lines.append("by option: " + ", ".join(f"{k}={v}" for k, v in sorted(report.by_option.items())))
    lines += ["4xx messages:"] + [f"  {n:5d}  {m}" for m, n in report.messages_4xx.most_common(25)]
    failing = report.failing()
    lines.append(f"failures: {len(failing)} (and {len(report.failures) - len(failing)} of ignored kinds)")
    for kind, n in Counter(f.kind for f in report.failures).most_common():
        first = [f for f in report.failures if f.kind == kind]
        ignored = " (ignored)" if kind in report.settings.get("ignore", ()) else ""
        lines.append(f"  {n:5d} {kind}{ignored}: {first[0].detail[:300]}")
        lines += [f"          {f.repro}" for f in first[:3] if f.repro]
    return "\n".join(lines)
