"""The checks that end a phase of the long fuzz with tiers (`tools/fuzz/soak.py`), on the idle
server, and the resident memory of the server's processes sampled while the phase runs.

- Counters that add up (`counter_relations`): relations between the `vllm:chunk_cache_*`
  counters that hold in the code at every idle moment, whatever the requests were.
- Documents looked up (`probe`): requests whose documents are known, one per recovery mode, sent
  alone; the device, host and remote hits plus the misses they add must equal the documents they
  bring (all of a request's documents; `last:K` brings all but its last K). Sent once, then again
  after a cache reset (from the store or computed): the same answers both times.
- Leaked pins and pages (`leak_check`): after a cache reset and one more step, no entry is left
  in the pool or the host tier and no page of either is in use.
- Resident memory (`RssSampler`, `rss_trend`): the RSS of the server's process tree, every few
  seconds; the least-squares slope over the last half of the requests, in % of its mean per
  1,000 requests.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from harness.rag_workload import chunked, document
from tools.fuzz.cases import MODEL_NAME, RECOVERY_KEY
from tools.fuzz.report import Report
from tools.fuzz.run import Target, chunk_metrics, idle_state
from vllm_ascend_chunk.config.recovery_modes import recovery_of
from vllm_ascend_chunk.metrics import ChunkCacheMetrics

PROBE_SYS = "You are a careful assistant. Answer from the documents."
PROBES = (
    ((0, 1, 2), "none"),
    ((0, 1, 2), "last:1"),
    ((1, 3), "last:2"),
    ((0, 3, 4), "qattn:0.5/2"),
    ((2,), "default"),
    ((4, 0, 1), "last:4"),
    ((3, 2, 0), "cover:0.6/0.2"),
)
"""(the probe documents a request brings, its recovery mode)."""


def counter_relations(m: ChunkCacheMetrics) -> dict[str, bool]:
    """Relations the counters keep whenever nothing is in flight (every remote read ended):

    - each remote read (an entry asked of the store) brings the entry or fails, once;
    - a remote hit is a chunk occurrence a read brought (SYS entries read are no hits);
    - an in-flight join is a miss that another request's prefill or read served;
    - a host-tier copy is made by a pool eviction and evicted at most once;
    - no object is rejected: the one secret signed every object (no other writer).
    """
    successful_reads = m.remote_reads - m.remote_read_failures
    return {
        "remote_read_failures <= remote_reads": m.remote_read_failures <= m.remote_reads,
        "remote_hits <= remote_reads - remote_read_failures": m.remote_hits <= successful_reads,
        "inflight_joins <= misses": m.inflight_joins <= m.miss_count,
        "host_evictions <= evictions": m.host_evictions <= m.evictions,
        "remote_rejected == 0": m.remote_rejected == 0,
    }


def looked_up(m: ChunkCacheMetrics) -> dict[str, int]:
    """The chunk occurrences each tier served, and the misses."""
    return {"device": m.hit_count, "host": m.host_hits, "remote": m.remote_hits, "miss": m.miss_count}


def probe_requests(seed: int) -> list[tuple[str, str, int]]:
    """(prompt, recovery mode, documents looked up) of the probes: documents no case sends."""
    docs = [document(900_000 + 10 * seed + k, 40) for k in range(5)]
    requests = []
    for i, (picks, mode) in enumerate(PROBES):
        recovery = recovery_of(mode) if mode != "default" else None
        computed = min(recovery.docs, len(picks)) if recovery else 0  # last:K: with the question
        prompt = chunked(PROBE_SYS, [docs[k] for k in picks], f"Probe {i}: which one first?")
        requests.append((prompt, mode, len(picks) - computed))
    return requests


def send_probe(http: httpx.Client, url: str, prompt: str, mode: str) -> list[int] | str:
    """One greedy probe: its token ids, or what went wrong."""
    body: dict = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    if mode != "default":
        body["vllm_xargs"] = {RECOVERY_KEY: mode}
    resp = http.post(url + "/v1/completions", json=body)
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}: {resp.text[:300]}"
    return resp.json()["choices"][0]["token_ids"]


def counted(url: str, before: dict[str, int], expected: int, timeout: float = 15.0) -> dict[str, int]:
    """The tiers' counts since `before`, polled until they sum to `expected` or `timeout` passes
    (counters trail the answers by an engine step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = chunk_metrics(url)
        now = looked_up(m) if m else before
        delta = {k: now[k] - before[k] for k in before}
        if sum(delta.values()) == expected or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def probe(report: Report, url: str, seed: int, when: str) -> dict:
    """Send the probes alone; their lookups must add up (failure `counters` otherwise)."""
    requests = probe_requests(seed)
    m = chunk_metrics(url)
    before = looked_up(m) if m else dict.fromkeys(("device", "host", "remote", "miss"), 0)
    with httpx.Client(timeout=120) as http:
        answers = [send_probe(http, url, prompt, mode) for prompt, mode, _ in requests]
    expected = sum(n for _, _, n in requests)
    delta = counted(url, before, expected)
    if bad := [a for a in answers if isinstance(a, str)]:
        report.fail("counters", f"{when}: probe not answered: {bad[0]}")
    if sum(delta.values()) != expected:
        report.fail(
            "counters", f"{when}: device + host + remote hits + misses grew by {delta}, not {expected}"
        )
    return {"documents_looked_up": expected, "by_tier": delta, "answers": answers}


def reset_cache(url: str) -> None:
    """vLLM's cache reset (`VLLM_SERVER_DEV_MODE=1`), which drops the chunk pool and host tier."""
    httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()


POOL_GAUGES = ("entries", "usage_ratio", "host_entries", "host_usage_ratio", "pinned_entries")


def leak_check(report: Report, url: str, timeout: float = 15.0) -> dict:
    """After a reset and a plain request (a step that reports the gauges): nothing in the pool or
    the host tier, no page of either in use (failure `leaked-pages` otherwise)."""
    reset_cache(url)
    with httpx.Client(timeout=120) as http:
        http.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1})
    deadline = time.monotonic() + timeout
    while True:
        m = chunk_metrics(url)
        gauges = {g: getattr(m, g) for g in POOL_GAUGES} if m else {}
        if (gauges and not any(gauges.values())) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not gauges or any(gauges.values()):
        report.fail("leaked-pages", f"after a reset with nothing in flight: {gauges}")
    return gauges


def remote_back(url: str, timeout: float = 60.0) -> float | None:
    """Seconds until the server's remote tier is up (`remote_up`; it retries every 5 s after a
    fault), None if it is not within `timeout`."""
    start = time.monotonic()
    while not ((m := chunk_metrics(url)) and m.remote_up):
        if time.monotonic() - start > timeout:
            return None
        time.sleep(0.5)
    return round(time.monotonic() - start, 1)


def audit(report: Report, url: str, seed: int) -> dict:
    """Every end-of-phase check on the idle server at `url`, once its remote tier is back;
    failures go to `report`."""
    in_flight, pinned = idle_state(url)
    remote_up_after_s = remote_back(url)
    first = probe(report, url, seed, "probe")
    reset_cache(url)
    again = probe(report, url, seed, "probe after a reset")
    if again["answers"] != first["answers"]:
        report.fail("mismatch-greedy", f"probes after a reset: {again['answers']} != {first['answers']}")
    gauges = leak_check(report, url)
    m = chunk_metrics(url)
    relations = counter_relations(m) if m else {}
    for relation, holds in relations.items():
        if not holds:
            report.fail("counters", f"at the end: {relation} does not hold ({m})")
    return {
        "idle_before": {"in_flight": in_flight, "pinned_entries": pinned},
        "probe": first,
        "probe_after_reset": again,
        "after_reset": gauges,
        "relations": relations,
        "remote_up_after_s": remote_up_after_s,
        "remote_up": bool(m and m.remote_up),
        "counters": {k: v for k, v in vars(m).items()} if m else {},
    }


def tree_rss(pid: int) -> tuple[int, int]:
    """Resident bytes of process `pid` and its descendants, and of `pid` alone (0s if gone)."""
    import psutil

    def rss(proc: psutil.Process) -> int:
        with contextlib.suppress(psutil.NoSuchProcess):
            return proc.memory_info().rss
        return 0

    try:
        root = psutil.Process(pid)
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, 0
    own = rss(root)
    return own + sum(rss(child) for child in children), own


class RssSampler:
    """Samples the RSS of `target`'s server tree every `interval_s` while in its `with` block."""

    def __init__(self, target: Target, answered: Callable[[], int], interval_s: float = 2.0) -> None:
        self.target = target
        self.answered = answered
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int, int]] = []
        """(seconds, requests answered, bytes of the tree, bytes of the API server process)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        server = self.target.server
        if server is not None and server.proc is not None:
            total, api_server = tree_rss(server.proc.pid)
            seconds = round(time.monotonic() - self._start, 2)
            self.samples.append((seconds, self.answered(), total, api_server))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()


@dataclass(frozen=True)
class RssTrend:
    """The least-squares line of RSS over requests answered, in the last half of a phase."""

    samples: int
    mean_mib: float
    slope_pct_per_1000: float | None
    """Growth per 1,000 requests, in % of the mean RSS (None: fewer than 3 samples)."""
    threshold_pct_per_1000: float

    @property
    def flat(self) -> bool:
        return self.slope_pct_per_1000 is not None and self.slope_pct_per_1000 < self.threshold_pct_per_1000


def rss_trend(samples: list[tuple], requests: int, threshold_pct: float) -> RssTrend:
    """The trend of the tree's RSS in the `RssSampler` samples taken once half of `requests` were
    answered."""
    import numpy as np

    last = [(n, rss) for _, n, rss, *_ in samples if n >= requests / 2 and rss > 0]
    if len(last) < 3 or len({n for n, _ in last}) < 2:
        mean = float(np.mean([r for _, r in last])) if last else 0.0
        return RssTrend(len(last), round(mean / 2**20, 1), None, threshold_pct)
    x = np.array([n for n, _ in last], dtype=float)
    y = np.array([r for _, r in last], dtype=float)
    slope = float(np.polyfit(x, y, 1)[0])  # bytes per request
    mean = float(y.mean())
    return RssTrend(len(last), round(mean / 2**20, 1), round(100 * 1000 * slope / mean, 4), threshold_pct)
