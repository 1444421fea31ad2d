"""A real `vllm serve` process for the tests, and what the tests read from it (every call timed out)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

from harness.serve_util import VllmServer, openai_client, scrape, tiny_serve_args
from harness.serve_util import requests_in_flight as requests_in_flight  # (re-exported)

TIMEOUT = 60
"""Seconds any single client call may take: a hang fails the test instead of stalling CI."""

WORKER_IN_ENGINE_CORE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""A test server's model worker runs in its engine-core process, as vLLM runs one GPU or NPU.
vLLM's CPU platform otherwise starts it in a third process (`mp` executor): one more vLLM import,
~13 s of CPU per server start on 2 cores. The worker in a process of its own (the scheduler's
metadata and the worker's stats crossing processes) is what the quick start, the demo, the P/D
pair, the GPU plan's benchmark, data parallelism and the TP/PP engines run; a test asks for it
with `env=OWN_PROCESS`."""
OWN_PROCESS: dict[str, str | None] = {"VLLM_ENABLE_V1_MULTIPROCESSING": None}
"""The CPU platform's default: the worker in a process of its own (each data-parallel rank's too)."""


@contextlib.contextmanager
def vllm_server(
    model_dir: Path, log: Path, env: dict[str, str | None] | None = None, extra_args: Sequence[str] = ()
) -> Iterator[str]:
    """`vllm serve` on `model_dir` as "tiny-llama" (float32, 4096 tokens, seed 0, then
    `extra_args`; its worker in the engine-core process unless `env` says otherwise:
    `WORKER_IN_ENGINE_CORE`); yields its URL."""
    args = [*tiny_serve_args("tiny-llama"), *extra_args]
    with VllmServer(model_dir, args, env=WORKER_IN_ENGINE_CORE | (env or {}), log_path=log) as server:
        yield server.url


def client(url: str, **kwargs):
    """An `openai.OpenAI` client that never retries (a dropped connection is an error) or hangs.

    Each request on a connection of its own (`Connection: close`): a request sent on an idle
    keep-alive connection just as the server closes it (uvicorn closes one idle for 5 s) is
    dropped unanswered, a race of HTTP/1.1 that a client which never retries would take for the
    server's failure (it failed a data-parallel test once in a full run)."""
    return openai_client(url, TIMEOUT, default_headers={"Connection": "close"}, **kwargs)


def greedy(client, prompt, max_tokens: int, stream: bool = False, **extra_body):
    """One greedy `/v1/completions` choice of "tiny-llama", with its token ids and logprobs
    (streamed: its pieces joined into `token_ids` and `logprobs.token_logprobs`)."""
    resp = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        stream=stream,
        extra_body={"ignore_eos": True, "return_token_ids": True} | extra_body,
    )
    if not stream:
        return resp.choices[0]
    pieces = [chunk.choices[0] for chunk in resp]
    logprobs = [x for p in pieces if p.logprobs for x in p.logprobs.token_logprobs]
    return SimpleNamespace(
        token_ids=[t for p in pieces for t in p.token_ids or []],
        logprobs=SimpleNamespace(token_logprobs=logprobs),
    )


def metrics(url: str):
    """The chunk cache metrics of the server (`vllm_ascend_chunk.metrics.ChunkCacheMetrics`)."""
    from vllm_ascend_chunk.metrics import ChunkCacheMetrics

    return ChunkCacheMetrics.from_prometheus_text(scrape(url))


def wait_metrics(url: str, ready: Callable[[object], bool], timeout: float = 10.0):
    """Poll `/metrics` until `ready(metrics)` (they trail a response by an engine step); the last scrape."""
    deadline = time.monotonic() + timeout
    while not ready(m := metrics(url)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return m
