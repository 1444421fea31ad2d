"""Long random fuzz of a real `vllm serve` with the chunk cache on (small pool, short context).

    .venv/bin/python -m tools.fuzz_server                      # 2,000 requests, seed 0
    .venv/bin/python -m tools.fuzz_server --seed 3 --requests 500 --concurrency 16
    .venv/bin/python -m tools.fuzz_server --seed 0 --only 137  # one case again
    .venv/bin/python -m tools.fuzz_server --no-prompt-logprobs --skip seed  # past known bugs

The server: the tiny Llama, `--max-model-len 1024`, a 48-page (768-token) chunk pool, chunked
prefill in 256-token steps, `--scheduling-policy priority` (with `fcfs` vLLM ignores priorities).
Requests: random chunked prompts (`SYSTEM # # DOC_1 # # ... # # QUESTION`, parts drawn from a
small corpus so documents repeat and evict each other, random delimiters and whitespace, empty
parts, unusual Unicode, sizes around the pool and max_model_len), plain prompts, completions and
chat, with random options (echo, logprobs, prompt_logprobs, n, best_of, beam search, stop, seed,
temperature, min/max tokens, truncate_prompt_tokens, response_format, priority), streamed or
not, some streams closed early. Case i is a function of (seed, i) alone: `--only i` re-sends it;
`--no-prompt-logprobs` and `--skip` drop options without changing anything else.

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
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.rag_workload import document
from benchmarks.serve_util import VllmServer, requests_in_flight, scrape

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "tiny-llama"
PAGE_TOKENS = 16
KV_BYTES_PER_TOKEN = 1024  # tiny Llama: 2 layers x (K, V) x 2 KV heads x 32 x float32

UNICODE = [
    "日本語の文書を検索する",
    "中文文档检索",
    "😀🚀👍🏽👨‍👩‍👧",
    "e\u0301 a\u0308 n\u0303 \u0338",
    "שלום עולם",
    "مرحبا بالعالم",
    "\u202eevil\u202c",
    "line\u2028sep\u2029para",
    "nul\x00in",
    "esc \x1b[31mred\x1b[0m",
    "zero\u200bwidth\ufeff",
    "\u3000ideographic\u00a0space",
    "Straße café",
]
DELIMITERS = [" # # ", "# #", "\n# #\n", "\t# #  ", "\u2028# #\u3000", "\u00a0# #\u2029"]
NOT_DELIMITERS = ["##", "#  #", "# ##", "#\u200b#"]
HASH_TEXT = ["Issue # # 5 is open.", "C# # F# # G are notes", "a # # b", "# #"]
SYSTEMS = [
    "You are a careful assistant. Answer from the documents.",
    "",
    "Sys \u00e9\u0301 日本",
    "You are a careful assistant. Answer from the documents. " * 6,
    "\x00",
    "S",
]
QUESTIONS = [
    "Which ferry?",
    "What is the answer?",
    "?",
    "",
    " \u2028\t",
    "日本語で答えて",
    "😀?",
    "Why # not?",
    "Explain the second document in detail, please.",
]
JSON_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["answer"],
}


@dataclass
class FuzzSettings:
    """What the fuzz sends and to which server."""

    seed: int = 0
    requests: int = 2000
    concurrency: int = 8
    timeout: float = 120.0
    max_model_len: int = 1024
    pool_pages: int = 48
    scheduling_policy: str = "priority"
    prompt_logprobs: bool = True
    max_deaths: int = 3
    ignore: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    only: list[int] | None = None

    @property
    def pool_gb(self) -> float:
        return self.pool_pages * PAGE_TOKENS * KV_BYTES_PER_TOKEN / 2**30


@dataclass
class Case:
    """One request: where it goes, its JSON body, and after how many stream events to hang up."""

    index: int
    endpoint: str
    body: dict
    disconnect_after: int | None = None

    @property
    def deterministic(self) -> bool:
        """Decoding that must give the same tokens whenever the request is asked."""
        if self.disconnect_after is not None:
            return False
        return self.body.get("temperature") == 0 or self.body.get("seed") is not None

    def options(self) -> list[str]:
        """The option names this case exercises (for the counts)."""
        names = [k for k in self.body if k not in ("model", "prompt", "messages", "return_token_ids")]
        names.append("chat" if "messages" in self.body else "completion")
        if self.disconnect_after is not None:
            names.append("disconnect")
        return names


@dataclass
class Outcome:
    """What the server answered: status (None: no answer), message, token ids per choice."""

    status: int | None
    message: str = ""
    token_ids: list[list[int]] | None = None
    stream_error_code: int | None = None
    kind: str = ""  # "", "timeout", "connection"
    seconds: float = 0.0


@dataclass
class Failure:
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
    "closed-connection": "the server closed the keep-alive connection after answering (the next "
    "request on it fails)",
    "server-death": "/health failed after a request (the server is restarted)",
    "mismatch-greedy": "a temperature-0 answer differs from the same request's answer alone",
    "mismatch-seeded": "a seeded answer differs from the same request's answer alone",
    "in-flight": "requests still running or waiting with no client left",
    "leaked-pins": "chunk cache entries pinned with nothing in flight",
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
    return "python -m tools.fuzz_server " + " ".join(args)


@dataclass
class Report:
    settings: dict
    counts: Counter = field(default_factory=Counter)
    by_status: Counter = field(default_factory=Counter)
    by_option: Counter = field(default_factory=Counter)
    messages_4xx: Counter = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts.update({f"failure:{kind}": 0 for kind in FAILURE_KINDS} | {"server deaths": 0})

    def fail(self, kind: str, detail: str, case: Case | None = None) -> None:
        assert kind in FAILURE_KINDS, kind
        self.counts[f"failure:{kind}"] += 1
        repro = repro_command(self.settings, case.index) if case else ""
        self.failures.append(Failure(kind, detail, asdict(case) if case else None, repro))

    def failing(self) -> list[Failure]:
        """The failures that count (not of a kind in `settings["ignore"]`)."""
        return [f for f in self.failures if f.kind not in self.settings.get("ignore", ())]

    def to_json(self) -> dict:
        return {
            "settings": self.settings,
            "counts": dict(self.counts),
            "by_status": dict(self.by_status),
            "by_option": dict(sorted(self.by_option.items())),
            "messages_4xx": dict(self.messages_4xx.most_common()),
            "failing": len(self.failing()),
            "failures": [asdict(f) for f in self.failures],
        }


# --- random cases -------------------------------------------------------------------------------


def corpus(seed: int) -> list[str]:
    """Documents of 1 to ~400 tokens (the pool holds ~750), some in unusual Unicode; the first
    ones, which `chunked_prompt` picks most often, are the shortest, so they stay in the pool."""
    rng = random.Random(seed)
    sizes = sorted(rng.choice([1, 2, 5, 10, 20, 40, 60, 80, 100, 150, 200, 300, 400]) for _ in range(20))
    docs = [document(7000 + seed * 100 + i, size) for i, size in enumerate(sizes)]
    docs += [u * rng.randint(1, 20) for u in UNICODE]
    return docs + ["", "   ", "\u2028"]


def noisy(rng: random.Random, text: str, rate: float = 1.0) -> str:
    """`text` with random whitespace around it, sometimes a Unicode insert (less of both with a
    lower `rate`: a prompt's leading whitespace is part of SYSTEM, hence of every chunk key)."""
    ws = ["", " ", "\n", "\t", "\u2028", "\u3000", "  \n "]
    if rng.random() < 0.1 * rate:
        cut = rng.randint(0, len(text))
        text = text[:cut] + rng.choice(UNICODE) + text[cut:]
    lead = rng.choice(ws) if rng.random() < rate else ""
    return lead + text + rng.choice(ws)


def chunked_prompt(rng: random.Random, docs: list[str], max_model_len: int) -> str:
    """SYSTEM, 0-10 documents (popular ones first), a question, random delimiters between them."""
    k = rng.choice([0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 8, 10])
    picks = [
        docs[min(int(rng.paretovariate(1.0)) - 1, len(docs) - 1)] if rng.random() < 0.6 else rng.choice(docs)
        for _ in range(k)
    ]
    question = rng.choice(QUESTIONS)
    if rng.random() < 0.05:
        question = document(rng.randint(0, 10**6), rng.choice([max_model_len // 2, max_model_len]))
    parts = [rng.choice(SYSTEMS), *picks, question]
    out = noisy(rng, parts[0], rate=0.2)
    for part in parts[1:]:
        delim = rng.choice(NOT_DELIMITERS) if rng.random() < 0.03 else rng.choice(DELIMITERS)
        out += delim + noisy(rng, part)
    return out


def plain_prompt(rng: random.Random, docs: list[str], max_model_len: int) -> str:
    """An ordinary prompt: text, perhaps with one `# #` or `# #` in ordinary words."""
    text = rng.choice(
        [
            rng.choice(docs),
            rng.choice(HASH_TEXT),
            rng.choice(QUESTIONS) or "Hi",
            document(rng.randint(0, 10**6), rng.choice([50, max_model_len])),
        ]
    )
    if rng.random() < 0.5:
        text += " " + rng.choice(HASH_TEXT)
    return text


def messages(rng: random.Random, prompt: str) -> list[dict]:
    """The prompt as one user message, or split into a system and a user message."""
    if rng.random() < 0.7 or "# #" not in prompt:
        return [{"role": "user", "content": prompt}]
    head, _, tail = prompt.partition("# #")
    return [{"role": "system", "content": head + "# #"}, {"role": "user", "content": tail}]


def sampling_options(rng: random.Random, body: dict) -> None:
    """temperature, seed, n, best_of, beam search, max/min tokens, stop, ignore_eos."""
    body["temperature"] = rng.choice([0, 0, 0, 0.7, 1.5, None])
    if rng.random() < 0.35:
        body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.15:
        body["n"] = rng.randint(2, 3)
        if body.get("temperature") == 0 and rng.random() < 0.7:  # n > 1 needs sampling (vLLM)
            body["temperature"] = 1.0
    if rng.random() < 0.05:
        body["best_of"] = body.get("n", 1) + rng.randint(0, 2)
    if rng.random() < 0.02:
        body["use_beam_search"] = True
    body["max_tokens"] = (
        rng.choice([1, 2, 4, 4, 8, 8, 16, 16, 32, None]) if rng.random() < 0.94 else rng.choice([0, 4096])
    )
    if rng.random() < 0.15:
        body["min_tokens"] = rng.randint(0, min(10, body.get("max_tokens") or 16) + rng.choice([0, 0, 0, 4]))
    if rng.random() < 0.2:
        stops = [".", ["\n", "ou"], ["a", "e", " "], "日本", "」", [""] if rng.random() < 0.2 else "?"]
        body["stop"] = rng.choice(stops)
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    for key in [k for k, v in body.items() if v is None]:
        del body[key]


def logprob_options(rng: random.Random, body: dict, chat: bool, prompt_logprobs: bool) -> None:
    """echo, logprobs, prompt_logprobs. Without `prompt_logprobs`, no prompt logprobs are asked
    (no `prompt_logprobs`, no `echo` with `logprobs`); the same random draws either way."""
    if rng.random() < 0.2:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
        else:
            body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.12:
        body["echo"] = True
    if rng.random() < 0.1:
        body["prompt_logprobs"] = rng.choice([0, 1, 3, -1])
    if rng.random() < 0.05:
        body["return_tokens_as_token_ids"] = True
    if not prompt_logprobs:  # chat's echo asks for prompt logprobs (top_logprobs, default 0)
        body.pop("prompt_logprobs", None)
        if chat:
            body.pop("echo", None)
        elif body.get("echo"):
            body.pop("logprobs", None)


def other_options(rng: random.Random, body: dict, settings: FuzzSettings) -> None:
    """truncate_prompt_tokens, response_format, priority."""
    if rng.random() < 0.1:
        body["truncate_prompt_tokens"] = rng.choice([-1, 1, 8, 64, 512, settings.max_model_len])
    if rng.random() < 0.08:
        body["response_format"] = rng.choice(
            [
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "answer", "schema": JSON_SCHEMA}},
            ]
        )
    if rng.random() < 0.15:
        body["priority"] = rng.randint(-5, 5)


def make_case(settings: FuzzSettings, docs: list[str], index: int) -> Case:
    """Case `index` of the run with `settings.seed`: a function of (seed, index) alone."""
    rng = random.Random(f"{settings.seed}:{index}")
    chat = rng.random() < 0.3
    build = plain_prompt if rng.random() < 0.12 else chunked_prompt
    prompt = build(rng, docs, settings.max_model_len)
    body: dict = {"model": MODEL_NAME, "return_token_ids": True}
    body.update({"messages": messages(rng, prompt)} if chat else {"prompt": prompt})
    sampling_options(rng, body)
    logprob_options(rng, body, chat, settings.prompt_logprobs)
    other_options(rng, body, settings)
    for key in settings.skip:
        body.pop(key, None)
    disconnect = None
    if rng.random() < 0.3:
        body["stream"] = True
        if rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.3:
            disconnect = rng.randint(0, 3)
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    return Case(index, endpoint, body, disconnect)


def make_cases(settings: FuzzSettings) -> list[Case]:
    docs = corpus(settings.seed)
    indices = settings.only if settings.only is not None else range(settings.requests)
    return [make_case(settings, docs, i) for i in indices]


# --- sending ------------------------------------------------------------------------------------


def error_message(text: str) -> str:
    """The message of an error body (vLLM: {"error": {"message": ...}}; FastAPI: {"detail": ...})."""
    try:
        data = json.loads(text)
    except ValueError:
        return ""
    if isinstance(data, dict):
        err = data.get("error", data)
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
        return str(msg or "")
    return ""


def choice_tokens(choices: list[dict], into: dict[int, list[int]]) -> None:
    for choice in choices:
        into.setdefault(choice.get("index", 0), []).extend(choice.get("token_ids") or [])


async def read_stream(resp: httpx.Response, case: Case, out: Outcome) -> None:
    """Read a stream's events: token ids per choice, an error event; hang up early if asked."""
    tokens: dict[int, list[int]] = {}
    events = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            out.stream_error_code = int(event["error"].get("code") or 0)
            out.message = str(event["error"].get("message") or "")
            break
        choice_tokens(event.get("choices") or [], tokens)
        events += 1
        if case.disconnect_after is not None and events >= case.disconnect_after:
            return
    out.token_ids = [tokens[i] for i in sorted(tokens)]


async def exchange(http: httpx.AsyncClient, url: str, case: Case, out: Outcome) -> None:
    """POST `case` and read the whole answer (or the stream up to the hang-up) into `out`."""
    async with http.stream("POST", url + case.endpoint, json=case.body) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            out.message = error_message((await resp.aread()).decode(errors="replace"))
        elif case.body.get("stream"):
            await read_stream(resp, case, out)
        else:
            tokens: dict[int, list[int]] = {}
            choice_tokens(json.loads(await resp.aread()).get("choices") or [], tokens)
            out.token_ids = [tokens[i] for i in sorted(tokens)]


async def send(http: httpx.AsyncClient, url: str, case: Case, timeout: float) -> Outcome:
    """Send `case` within `timeout` seconds; a timeout or a dropped connection is the outcome's kind."""
    start = time.monotonic()
    out = Outcome(status=None)
    try:
        await asyncio.wait_for(exchange(http, url, case, out), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        out.kind = "timeout"
    except (httpx.HTTPError, ValueError) as err:
        out.kind = "connection"
        out.message = f"{type(err).__name__}: {err}"
    out.seconds = time.monotonic() - start
    return out


async def health(http: httpx.AsyncClient, url: str) -> str:
    """ "" if `/health` answers 200 within 30 s, else what it answered."""
    try:
        status = (await http.get(url + "/health", timeout=30)).status_code
    except httpx.HTTPError as err:
        return f"{type(err).__name__}: {err}"
    return "" if status == 200 else f"HTTP {status}"


async def after_request(http: httpx.AsyncClient, url: str) -> tuple[str, str]:
    """`/health` on the connection the request used, then, if that fails, on a new one: (what the
    first answered, what the new one answered); ("x", "") means the server closed the
    request's keep-alive connection after its answer, ("x", "y") that the server is down."""
    first = await health(http, url)
    if not first:
        return "", ""
    async with httpx.AsyncClient() as fresh:
        return first, await health(fresh, url)


def log(message: str) -> None:
    print(f"[fuzz {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- checking -----------------------------------------------------------------------------------


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
        report.fail("5xx", f"HTTP {out.status}: {out.message}", case)
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


def chunk_metrics(url: str):
    """The server's `ChunkCacheMetrics`, None before the engine's first step reports them."""
    from vllm_ascend_chunk.metrics import ChunkCacheMetrics

    try:
        return ChunkCacheMetrics.from_prometheus_text(scrape(url))
    except LookupError:
        return None


def pinned_entries(url: str) -> int:
    """`vllm:chunk_cache_pinned_entries` (0 before the engine's first step reports it)."""
    m = chunk_metrics(url)
    return m.pinned_entries if m else 0


def idle_state(url: str, timeout: float = 30.0) -> tuple[int, int]:
    """(running + waiting requests, pinned chunk cache entries), polled until both are 0 (the
    metrics trail the answers by an engine step) or `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while (state := (requests_in_flight(url), pinned_entries(url))) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    return state


def check_idle(report: Report, url: str, when: str) -> None:
    try:
        in_flight, pinned = idle_state(url)
    except OSError as err:
        report.fail("server-death", f"{when}: /metrics failed: {err}")
        return
    if in_flight:
        report.fail("in-flight", f"{when}: {in_flight} running + waiting")
    if pinned:
        report.fail("leaked-pins", f"{when}: {pinned} entries pinned with nothing in flight")


# --- running ------------------------------------------------------------------------------------


class Target:
    """The server under test: one we started (restarted when it dies), or a given URL."""

    def __init__(self, url: str | None = None, start: Callable[[int], VllmServer] | None = None) -> None:
        self._start = start
        self.server: VllmServer | None = None
        self.url = url or ""
        self.restarts = 0

    def __enter__(self) -> Target:
        if self._start is not None:
            self.server = self._start(0).start()
            self.url = self.server.url
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()

    def restart(self) -> bool:
        """Start a fresh server; False if this target cannot (a given URL)."""
        if self._start is None:
            return False
        assert self.server is not None
        self.server.stop()
        self.restarts += 1
        log(f"restarting the server ({self.restarts})")
        self.server = self._start(self.restarts).start()
        self.url = self.server.url
        return True


async def run_batch(
    target: Target, cases: list[Case], settings: FuzzSettings, report: Report
) -> tuple[dict[int, Outcome], list[Case]]:
    """Send `cases` with `settings.concurrency` in flight; stop at a server death. The outcomes
    by case index and the cases not sent."""
    queue = list(reversed(cases))
    outcomes: dict[int, Outcome] = {}
    dead = asyncio.Event()
    in_flight: set[int] = set()

    async def worker(http: httpx.AsyncClient) -> None:
        while queue and not dead.is_set():
            case = queue.pop()
            in_flight.add(case.index)
            out = await send(http, target.url, case, settings.timeout)
            outcomes[case.index] = out
            check_outcome(report, case, out)
            if len(outcomes) % 100 == 0:
                log(f"{len(outcomes)} of {len(cases)} answered, {len(report.failures)} failures")
            closed, sick = await after_request(http, target.url)
            if closed and not sick:
                report.fail(
                    "closed-connection",
                    f"/health on the request's keep-alive "
                    f"connection: {closed} (HTTP {out.status} {out.message[:200]!r})",
                    case,
                )
            elif sick and not dead.is_set():
                dead.set()
                report.counts["server deaths"] += 1
                suspects = sorted(in_flight)
                report.fail(
                    "server-death",
                    f"/health: {sick} after case {case.index} (HTTP {out.status} "
                    f"{out.message[:300]!r}); in flight: {suspects}",
                    case,
                )
                log(f"server death after case {case.index}; in flight {suspects}")
            in_flight.discard(case.index)

    async def one_connection_worker() -> None:
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(timeout=settings.timeout, limits=limits) as http:
            await worker(http)

    await asyncio.gather(*(one_connection_worker() for _ in range(settings.concurrency)))
    return outcomes, list(reversed(queue))


async def run_phase(
    target: Target, cases: list[Case], settings: FuzzSettings, report: Report
) -> dict[int, Outcome]:
    """All `cases`, restarting a dead server (and going on, up to `settings.max_deaths` times)."""
    outcomes: dict[int, Outcome] = {}
    while cases:
        deaths = report.counts["server deaths"]
        done, cases = await run_batch(target, cases, settings, report)
        outcomes.update(done)
        if report.counts["server deaths"] == deaths:
            break
        if not target.restart() or report.counts["server deaths"] > settings.max_deaths:
            report.counts["not sent"] += len(cases)
            break
    return outcomes


async def reference_pass(
    target: Target, cases: list[Case], outcomes: dict[int, Outcome], settings: FuzzSettings, report: Report
) -> None:
    """Re-send every deterministic 200 alone, one at a time, and compare."""
    alone_settings = FuzzSettings(**{**asdict(settings), "concurrency": 1})
    todo = [c for c in cases if c.deterministic and c.index in outcomes and clean(outcomes[c.index])]
    sub = Report(settings=report.settings)
    alone = await run_phase(target, todo, alone_settings, sub)
    report.counts.update(
        {k: v for k, v in sub.counts.items() if k.startswith("failure:") or k == "server deaths"}
    )
    report.failures += sub.failures
    for case in todo:
        if case.index in alone and clean(alone[case.index]):
            check_reference(report, case, outcomes[case.index], alone[case.index])


def fuzz(target: Target, settings: FuzzSettings) -> Report:
    """The whole fuzz against `target`: the concurrent pass, the idle check, the reference pass
    and the idle check again."""
    report = Report(settings=asdict(settings))
    cases = make_cases(settings)
    start = time.monotonic()
    outcomes = asyncio.run(run_phase(target, cases, settings, report))
    report.counts["seconds concurrent"] = round(time.monotonic() - start)
    check_idle(report, target.url, "after the concurrent pass")
    asyncio.run(reference_pass(target, cases, outcomes, settings, report))
    check_idle(report, target.url, "after the reference pass")
    report.counts["seconds"] = round(time.monotonic() - start)
    report.counts["server restarts"] = target.restarts
    if m := chunk_metrics(target.url):  # the last server's: what the fuzz made the pool do
        report.counts.update(
            {
                "chunk cache hits": m.hit_count,
                "chunk cache misses": m.miss_count,
                "chunk cache evictions": m.evictions,
                "chunk prefills": m.chunk_prefills,
                "chunk cache inflight joins": m.inflight_joins,
            }
        )
    return report


def server_factory(model: Path, settings: FuzzSettings, log: Path | None) -> Callable[[int], VllmServer]:
    """A function that makes the (not yet started) small-pool server for `settings`; start k
    logs to `log` + ".k" (k > 0)."""
    args = [
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "float32",
        "--seed",
        "0",
        "--max-model-len",
        str(settings.max_model_len),
        "--max-num-batched-tokens",
        "256",
        "--scheduling-policy",
        settings.scheduling_policy,
    ]
    env = {
        "VLLM_CHUNK_CACHE_SIZE_GB": f"{settings.pool_gb:.12g}",
        "VLLM_ENABLE_CHUNK_CACHE": "true",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }

    def make(k: int) -> VllmServer:
        path = log.with_name(f"{log.name}.{k}") if log and k else log
        return VllmServer(model, args, env=env, log_path=path)

    return make


def summary(report: Report) -> str:
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


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, FuzzSettings]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = FuzzSettings()
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
    p.add_argument("--max-deaths", type=int, default=d.max_deaths, help="server restarts before giving up")
    p.add_argument(
        "--only",
        type=lambda s: [int(i) for i in s.split(",")],
        default=None,
        help="only these case indices (comma-separated), to reproduce a failure",
    )
    p.add_argument("--url", default=None, help="fuzz this running server instead of starting one")
    p.add_argument("--model", type=Path, default=REPO / ".models" / "tiny-llama")
    p.add_argument("--log", type=Path, default=None, help="server log (default: a temporary file)")
    p.add_argument("--out", type=Path, default=Path("fuzz_server.json"), help="JSON report")
    p.add_argument("--print-cases", action="store_true", help="print the cases' JSON and exit")
    args = p.parse_args(argv)
    if unknown := set(args.ignore) - set(FAILURE_KINDS):
        p.error(f"--ignore: unknown failure kinds {sorted(unknown)}")
    settings = FuzzSettings(
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
    )
    return args, settings


def main(argv: list[str] | None = None) -> int:
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
