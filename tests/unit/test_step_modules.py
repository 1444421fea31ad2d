"""`tools.dev.step_modules` (issue 39's measure) on a real test: a remote read through the coordinator,
step by step, enters the coordinator, the manager and the remote store's tier in its steps."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import REPO

SCENARIO = (
    "tests/unit/test_coordinator.py::"
    "test_reads_from_the_remote_store_that_arrive_load_and_those_that_fail_are_computed"
)


def test_the_plugin_counts_the_modules_of_each_step():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tools.dev.step_modules", "-p", "no:xdist",
         "-p", "no:cacheprovider", "-q", SCENARIO],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = re.search(
        r"step modules: (\d+) steps, mean ([\d.]+), max (\d+), (\d+) modules in all", run.stdout
    )
    assert found, run.stdout[-3000:]
    steps, mean, largest, total = int(found[1]), float(found[2]), int(found[3]), int(found[4])
    assert steps == 6, "the scenario's five plans, and what it does before the first"
    assert 3 <= mean <= largest <= total
