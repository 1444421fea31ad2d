"""The long fuzz with tiers and store faults (`tools/fuzz/soak.py`, the code of the committed
10,000-request run) at a tiny scale: 60 random requests with a recovery mode each, 2 in flight,
against a real `vllm serve` with a host tier and a real Mooncake Store (objects signed), one fault
of each kind while they run (a part of objects removed, the store paused, a slow store, the master
killed and restarted). No server death, no deterministic answer different from the same request's
alone, nothing pinned or left in the pool after a reset, counters that add up, the remote tier up
again at the end, and the resident memory sampled and plotted (too few samples here to judge its
trend)."""

from __future__ import annotations

import json
from pathlib import Path

from harness.store_faults import FAULTS
from tests.helpers import server_utils
from tools.fuzz import soak as fuzz_soak

ARGS = [
    "--seed", "56", "--requests", "60", "--concurrency", "2", "--tp2-fraction", "0", "--skip", "seed",
    "--max-deaths", "0", "--timeout", str(server_utils.TIMEOUT),
    "--faults", "parts=0.2,pause=0.4,slow=0.55,master=0.7", "--pause-s", "0.5", "--slow-s", "1",
    "--rss-interval-s", "0.5",
]  # fmt: skip


def test_fuzz_soak_slice(models_dir: Path, tmp_path: Path):
    out = tmp_path / "soak.json"
    args = [*ARGS, "--model", str(models_dir / "tiny-llama"), "--log-dir", str(tmp_path), "--out", str(out)]
    fuzz_soak.main(args)
    report = json.loads(out.read_text())
    (phase,) = report["phases"]
    failures = json.dumps(phase["fuzz"]["failures"][:5], ensure_ascii=False)[:3000]
    verdicts = {k: v for k, v in report["pass"].items() if k != "rss_flat_last_half"}
    assert all(verdicts.values()), f"{report['pass']}: {failures}"
    assert phase["fuzz"]["counts"]["requests"] == 60
    assert {f["kind"] for f in phase["faults"]} == set(FAULTS), phase["faults"]
    assert phase["audit"]["probe"]["documents_looked_up"] > 0
    assert phase["audit"]["probe_after_reset"]["by_tier"]["host"] == 0, "the reset drops the host tier"
    samples = phase["rss_samples_mib"]
    assert len(samples) >= 2 and all(tree > api > 0 for _, _, tree, api in samples), samples
    assert out.with_suffix(".png").stat().st_size > 0
