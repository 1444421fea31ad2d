"""The checkout-against-checkout benchmark without servers: its ratios and noise intervals, and a
server started from another checkout."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from benchmarks import bench_baseline
from harness.serve_util import VllmServer


def samples(scale: float, seed: int) -> dict[str, list[list[float]]]:
    """40 rounds of 10 samples per figure."""
    rng = random.Random(seed)
    return {
        key: [[scale * rng.uniform(9, 11) for _ in range(10)] for _ in range(40)]
        for key, _ in bench_baseline.FIGURE_OF.values()
    }


def test_the_same_distribution_is_within_noise_and_a_slower_one_is_not():
    same = bench_baseline.ratios({"this": samples(1.0, 1), "baseline": samples(1.0, 2)}, resamples=300)
    slower = bench_baseline.ratios({"this": samples(1.2, 1), "baseline": samples(1.0, 2)}, resamples=300)
    assert all(r["within_noise"] and r["ci95"][0] <= r["ratio"] <= r["ci95"][1] for r in same.values())
    assert all(not r["within_noise"] and r["ratio"] == pytest.approx(1.2, rel=0.05) for r in slower.values())


def test_a_server_from_another_checkout_runs_that_checkouts_interpreter_in_that_checkout(tmp_path: Path):
    server = VllmServer("model", checkout=tmp_path)
    assert server.command[0] == str(tmp_path / ".venv" / "bin" / "python")
    assert server.checkout == tmp_path
    assert VllmServer("model").checkout is None


def test_a_baseline_without_a_virtual_environment_is_refused_with_the_setup_step(tmp_path: Path, capsys):
    with pytest.raises(SystemExit):
        bench_baseline.parse_args(["--baseline", str(tmp_path)])
    assert "setup_env.sh" in capsys.readouterr().err
