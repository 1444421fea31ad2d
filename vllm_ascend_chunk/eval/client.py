"""The HTTP calls of an evaluation (standard library only), and what the server is.

`Server.check()` finds out, before anything is measured or written, that the server answers, that
it serves `--model`, and that its vLLM is patched with the chunk cache on, by sending one
chunked token-id prompt (`vllm_xargs.chunk_spans` as a JSON object, two tiny documents) and
reading the answer and `/metrics`:

- unpatched vLLM 0.23 refuses the object (its `vllm_xargs` values are scalars: HTTP 400 naming
  `vllm_xargs`): **not patched**;
- a patched server with `VLLM_ENABLE_CHUNK_CACHE=0` answers and drops the spans: no
  `vllm:chunk_cache_*` lookup moves (hits + misses): **chunk cache off**;
- a patched server with the chunk cache on looks both documents up: hits + misses grow by 2.

Every failure is an `EvalError` whose text names the fix.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

TIMEOUT = 600.0
"""Seconds one request may take (a long prefill on a slow machine included)."""


class EvalError(RuntimeError):
    """What stops an evaluation, and the fix."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}\n  fix: {fix}")
        self.problem, self.fix = problem, fix


class HTTPStatusError(RuntimeError):
    def __init__(self, status: int, body: str, path: str) -> None:
        super().__init__(f"HTTP {status} from {path}: {body[:500]}")
        self.status, self.body, self.path = status, body, path


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over its label sets}; `name{source="x"}`
    samples also under `name{x}` (one label's value), for the by-source counters."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][\w:]*)(\{.*\})?\s+(\S+)", line)
        if not m:
            continue
        name, labels, value = m.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        totals[name] = totals.get(name, 0.0) + number
        source = re.search(r'source="([^"]*)"', labels or "")
        if source:
            key = f"{name}{{{source.group(1)}}}"
            totals[key] = totals.get(key, 0.0) + number
    return totals


CHUNK = "vllm:chunk_cache_"
LOOKUPS = (f"{CHUNK}hits_total", f"{CHUNK}misses_total")
DONE = "vllm:request_success_total"
COMPUTED = "vllm:prompt_tokens_by_source_total{local_compute}"
SELECTED = f"{CHUNK}selected_tokens_total"
FALLBACKS = f"{CHUNK}cover_fallbacks_total"


@dataclass
class Answer:
    text: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int | None = None


class Server:
    """A running `vllm serve` at `base_url` serving `model`."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = TIMEOUT):
        self.url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.max_model_len: int | None = None

    # --- plain HTTP ------------------------------------------------------------------------------
    def _request(self, path: str, body: dict | None = None, timeout: float | None = None):
        headers = {"Content-Type": "application/json", "Connection": "close"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as exc:
            raise HTTPStatusError(exc.code, exc.read().decode(errors="replace"), path) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise EvalError(
                f"cannot reach the server at {self.url} ({path}: {reason})",
                "start `vllm serve` there, or pass the right --base-url (e.g. http://HOST:8000)",
            ) from None

    def get_json(self, path: str, timeout: float | None = None) -> dict:
        with self._request(path, timeout=timeout) as r:
            return json.loads(r.read())

    def post_json(self, path: str, body: dict) -> dict:
        with self._request(path, body) as r:
            return json.loads(r.read())

    def metrics(self) -> dict[str, float]:
        with self._request("/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    # --- what the server is ------------------------------------------------------------------------
    def check_model(self) -> None:
        """The server answers, takes our API key and serves `model`; sets `max_model_len`."""
        try:
            models = self.get_json("/v1/models", timeout=30)
        except HTTPStatusError as exc:
            if exc.status == 401:
                raise EvalError(
                    f"the server at {self.url} wants an API key "
                    f"({'a wrong one was given' if self.api_key else 'none given'})",
                    "pass --api-key KEY (or set VLLM_API_KEY), the key the server was started with",
                ) from None
            raise EvalError(
                f"{self.url} does not answer /v1/models like vLLM's OpenAI server ({exc})",
                "point --base-url at a `vllm serve` process",
            ) from None
        served = {m.get("id"): m for m in models.get("data", [])}
        if self.model not in served:
            raise EvalError(
                f"the server does not serve a model named {self.model!r}; "
                f"it serves {', '.join(map(repr, served)) or 'none'}",
                f"pass --model {next(iter(served), 'NAME')} (the server's --served-model-name)",
            )
        self.max_model_len = served[self.model].get("max_model_len")

    def check_chunk_cache(self, sys_ids: list[int], doc_ids: list[list[int]], q_ids: list[int]) -> None:
        """One chunked request of these pieces: refused (not patched), its spans dropped (chunk
        cache off), or its documents looked up in the pool (on)."""
        before = self.metrics()
        spans = {"sys_len": len(sys_ids), "chunk_lens": [len(d) for d in doc_ids]}
        ids = [t for part in (sys_ids, *doc_ids, q_ids) for t in part]
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "vllm_xargs": {"chunk_spans": spans, "chunk_cache_recovery": "none"},
        }
        try:
            self.post_json("/v1/completions", body)
        except HTTPStatusError as exc:
            if exc.status == 400 and "vllm_xargs" in exc.body and "chunk_spans" in exc.body:
                raise EvalError(
                    "the server's vLLM is not patched for the chunk cache: it refused a chunked token-id "
                    f"prompt's chunk_spans in vllm_xargs ({_message(exc.body)})",
                    "install this package in the server's environment, run `vllm-chunk-cache-patch` "
                    "(`--check` lists the patches), and restart `vllm serve`",
                ) from None
            raise EvalError(
                f"the server refused a chunked prompt ({exc})", "read the server's log for the cause"
            ) from None
        after = self.settled(before)
        if not any(name.startswith(CHUNK) for name in after):
            raise EvalError(
                "the chunk cache is off on this server: it served a chunked prompt as an ordinary one "
                "and /metrics has no vllm:chunk_cache_* counters",
                "restart the server with VLLM_ENABLE_CHUNK_CACHE=1 (the default), no --disable-log-stats",
            )
        looked_up = sum(after.get(n, 0.0) - before.get(n, 0.0) for n in LOOKUPS)
        if looked_up < len(doc_ids):
            raise EvalError(
                f"the chunk cache is off on this server: a chunked prompt of {len(doc_ids)} documents "
                f"looked {looked_up:.0f} up in the pool",
                "restart the server with VLLM_ENABLE_CHUNK_CACHE=1 (the default)",
            )

    def settled(self, before: dict[str, float], requests: int = 1, timeout: float = 10.0) -> dict[str, float]:
        """`/metrics` once `requests` more requests than in `before` have finished (the counters
        of a request's last engine step are recorded with its success)."""
        deadline = time.monotonic() + timeout
        while True:
            now = self.metrics()
            if now.get(DONE, 0.0) - before.get(DONE, 0.0) >= requests or time.monotonic() > deadline:
                return now
            time.sleep(0.02)

    # --- tokens and completions --------------------------------------------------------------------
    def tokenize(self, text: str, special: bool) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": special}
        return self.post_json("/tokenize", body)["tokens"]

    def tokenize_chat(self, system: str, user: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        return self.post_json("/tokenize", body)["tokens"]

    def prompt_parts(self, system: str, chat: bool = True) -> tuple[list[int], list[int]] | None:
        """(the ids before the user's content, the ids after it) of the chat template with this
        system message: the common head and tail of two renderings with different user text.
        None when the model has no chat template (`chat=False` or the server refuses)."""
        if not chat:
            return None
        try:
            a = self.tokenize_chat(system, "Alpha")
            b = self.tokenize_chat(system, "Omega")
        except HTTPStatusError as exc:
            if exc.status == 400:
                return None
            raise
        head = 0
        while head < min(len(a), len(b)) and a[head] == b[head]:
            head += 1
        tail = 0
        while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
            tail += 1
        return a[:head], a[len(a) - tail :]

    def complete(self, ids: list[int], max_tokens: int, xargs: dict | None = None) -> Answer:
        """One streamed greedy completion of the token ids; TTFT from sending to the first token."""
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if xargs:
            body["vllm_xargs"] = xargs
        start = time.perf_counter()
        ttft, pieces, usage = None, [], None
        with self._request("/v1/completions", body) as r:
            for event in _events(r):
                if event.get("choices"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    pieces.append(event["choices"][0].get("text") or "")
                if event.get("usage"):
                    usage = event["usage"]
        end = time.perf_counter() - start
        return Answer(
            text="".join(pieces).strip(),
            ttft_s=ttft if ttft is not None else end,
            latency_s=end,
            prompt_tokens=(usage or {}).get("prompt_tokens"),
        )


def _events(response) -> Iterator[dict]:
    """The JSON events of a server-sent event stream, up to `data: [DONE]`."""
    for raw in response:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise HTTPStatusError(
                event["error"].get("code", 500) or 500, json.dumps(event), "/v1/completions"
            )
        yield event


def _message(body: str) -> str:
    """The error message of an OpenAI-style error body, shortened."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body
    return " ".join(str(message).split())[:300]
