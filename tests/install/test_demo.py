"""The README's first command, `scripts/demo.sh`, end to end: set-up (already done, so quick), a
real `vllm serve` on bench-llama with the chunk cache on, 19 requests, the per-request table, the
plot. It was broken for a while without anybody noticing; this keeps it working."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from tests.helpers import REPO

ROW = re.compile(
    r"^\s*(\d+)\s+(warmup|sweep|stream|shuffled)\s+(cold|warm|mixed)\s+[\d ]+?\s+(\d+)\s+(\d+)\s+([\d.]+)$"
)


def test_the_demo_prints_every_request_and_writes_its_plot(tmp_path: Path):
    run = subprocess.run(
        [str(REPO / "scripts" / "demo.sh"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    samples = json.loads((tmp_path / "demo.json").read_text())["samples"]
    rows = [m.groups() for line in run.stdout.splitlines() if (m := ROW.match(line))]
    assert len(rows) == len(samples) == 19, run.stdout
    for sample, (index, phase, kind, hits, misses, ttft) in zip(samples, rows, strict=True):
        assert (int(index), phase) == (sample["index"], sample["phase"])
        assert sample["completion_tokens"] and float(ttft) > 0  # answered
        assert int(hits) + int(misses) == sample["n_docs"]  # every document counted once
        if kind == "warm":
            assert int(hits) == sample["n_docs"] and int(misses) == 0, sample
        if kind == "cold":
            assert int(hits) == 0, sample
    # Documents seen before are hits, wherever they stand: every repeated set reordered.
    assert all(int(r[3]) > 0 for r in rows if r[1] in ("sweep", "shuffled") and r[2] == "warm")
    assert "TTFT (ms, p50) vs documents" in run.stdout
    assert (tmp_path / "demo.png").stat().st_size > 10_000
