"""`tools.dev.step_modules` (issue 39's measure), a pytest plugin, run as it is used: on a scenario
whose modules per step are counted by hand, and on a real test (a remote read through the
coordinator, step by step)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.helpers import REPO

SCENARIO = (
    "tests/unit/test_coordinator.py::"
    "test_reads_from_the_remote_store_that_arrive_load_and_those_that_fail_are_computed"
)
HAND_COUNTED = """
from types import SimpleNamespace

from vllm_ascend_chunk.config.variables import bool_word
from vllm_ascend_chunk.core.geometry import auto_pool_bytes
from vllm_ascend_chunk.core.paging import pages_for, slot_of
from vllm_ascend_chunk.scheduler.coordinator import ChunkCacheCoordinator

# A coordinator whose collaborators live in this file (outside the package): its `plan` enters
# scheduler/coordinator.py and no other module of the package.
IDLE = SimpleNamespace(
    _order=lambda: [], _unplan_behind_blocked=lambda order: None, _refill=lambda: [],
    manager=SimpleNamespace(stats=SimpleNamespace(chunk_prefills=0)),
)


def test_scenario():
    pages_for(5, 4)  # before the first plan, step 1: core/paging.py
    bool_word("yes")  # step 1: config/variables.py
    ChunkCacheCoordinator.plan(IDLE)  # step 2: scheduler/coordinator.py
    pages_for(1, 4)  # step 2: core/paging.py
    auto_pool_bytes(1 << 30)  # step 2: core/geometry.py
    slot_of([0], 4, 1)  # step 2: core/paging.py again (another function), counted once
    ChunkCacheCoordinator.plan(IDLE)  # step 3: scheduler/coordinator.py alone
"""
SUMMARY = r"step modules: (\d+) steps, mean ([\d.]+), max (\d+), (\d+) modules in all"


def step_modules(*args: str, cwd=REPO) -> re.Match:
    """The plugin's summary line of a pytest run of `args`."""
    paths = (str(REPO), os.environ.get("PYTHONPATH", ""))  # the package, from any directory
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tools.dev.step_modules", "-p", "no:xdist",
         "-p", "no:cacheprovider", "-q", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = re.search(SUMMARY, run.stdout)
    assert found, run.stdout[-3000:]
    return found


def test_the_plugin_counts_the_modules_of_each_step_as_counted_by_hand(tmp_path):
    (tmp_path / "test_scenario.py").write_text(HAND_COUNTED)
    found = step_modules("-c", os.devnull, "--rootdir", str(tmp_path), "test_scenario.py", cwd=tmp_path)
    # Steps of 2, 3 and 1 modules; paging, settings, coordinator and geometry in all.
    assert found.groups() == ("3", "2.0", "3", "4"), found[0]


def test_the_plugin_finds_the_steps_of_a_coordinator_test():
    found = step_modules(SCENARIO)
    steps, mean, largest, total = int(found[1]), float(found[2]), int(found[3]), int(found[4])
    assert steps == 6, "the scenario's five plans, and what it does before the first"
    assert 3 <= mean <= largest <= total
