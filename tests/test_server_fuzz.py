"""A CI-sized slice of the long fuzz (`scripts/fuzz_server.py`, same code): 80 random requests,
4 in flight, on its own small-pool, short-context server. Every answer is a 200 or a 4xx with a
message, the server stays healthy, deterministic answers equal those given alone, and nothing
stays pinned."""

from __future__ import annotations

from pathlib import Path

import fuzz_server
import server_utils

SETTINGS = fuzz_server.FuzzSettings(seed=12, requests=80, concurrency=4, timeout=server_utils.TIMEOUT,
                                    max_deaths=0)


def test_fuzz_slice(models_dir: Path, tmp_path: Path):
    start = fuzz_server.server_factory(models_dir / "tiny-llama", SETTINGS, tmp_path / "vllm-serve.log")
    with fuzz_server.Target(start=start) as target:
        report = fuzz_server.fuzz(target, SETTINGS)
    assert report.counts["requests"] >= SETTINGS.requests
    assert not report.failures, fuzz_server.summary(report)
