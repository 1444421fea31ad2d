"""Running the fuzz against a server: the concurrent pass, the reference pass (every
deterministic answer again, alone), the idle checks, and restarting a dead server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from harness.serve_util import VllmServer, requests_in_flight, scrape
from tools.fuzz.cases import MODEL_NAME, Case, FuzzSettings, make_cases
from tools.fuzz.client import Outcome, after_request, send
from tools.fuzz.report import Report, check_outcome, check_reference, clean, server_error_kind

if TYPE_CHECKING:
    from vllm_ascend_chunk.metrics import ChunkCacheMetrics


def log(message: str) -> None:
    """A progress line on stderr."""
    print(f"[fuzz {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def chunk_metrics(url: str) -> ChunkCacheMetrics | None:
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
    """With nothing in flight: no request running or waiting, no chunk cache entry pinned."""
    try:
        in_flight, pinned = idle_state(url)
    except OSError as err:
        report.fail("server-death", f"{when}: /metrics failed: {err}")
        return
    if in_flight:
        report.fail("in-flight", f"{when}: {in_flight} running + waiting")
    if pinned:
        report.fail("leaked-pins", f"{when}: {pinned} entries pinned with nothing in flight")


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
                known = (out.status or 0) >= 500 and server_error_kind(case)[0] == "vllm-known"
                report.fail(
                    "vllm-known" if known else "closed-connection",
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


def fuzz(
    target: Target,
    settings: FuzzSettings,
    during: Callable[[Report], AbstractContextManager] | None = None,
) -> Report:
    """The whole fuzz against `target`: the concurrent pass (inside `during(report)`, e.g. faults
    injected as `report.counts["requests"]` grows), the idle check, the reference pass and the
    idle check again."""
    report = Report(settings=asdict(settings))
    cases = make_cases(settings)
    start = time.monotonic()
    with during(report) if during else contextlib.nullcontext():
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


def server_factory(
    model: Path,
    settings: FuzzSettings,
    log: Path | None,
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> Callable[[int], VllmServer]:
    """A function that makes the (not yet started) small-pool server for `settings`, with
    `extra_env` and `extra_args` (tiers, parallelism); start k logs to `log` + ".k" (k > 0)."""
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
        *extra_args,
    ]
    env = {
        "VLLM_CHUNK_CACHE_SIZE_GB": f"{settings.pool_gb:.12g}",
        "VLLM_ENABLE_CHUNK_CACHE": "true",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # The check that a request's connection still answers /health is after a close on an
        # answer (an error that re-raises), which is at once; uvicorn's idle close (5 s by
        # default) would also close it when the fuzz process stalls that long between the two
        # (its store faults call Mooncake in-process), a failure of the harness, not the server.
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60",
        **(extra_env or {}),
    }

    def make(k: int) -> VllmServer:
        path = log.with_name(f"{log.name}.{k}") if log and k else log
        return VllmServer(model, args, env=env, log_path=path)

    return make
