"""How many of the package's modules a scheduler step enters (issue 39's measure), as a pytest
plugin:

    python -m pytest -p tools.dev.step_modules -p no:xdist -q TEST_ID [TEST_ID ...]

A step runs from one call of `ChunkCacheCoordinator.plan` to the next (the scheduler plans at the
start of every step); each module of `vllm_ascend_chunk` with a function called in between, by
the coordinator or by the test driving it, counts once for that step. The summary line gives the
steps, the mean and the largest number of modules per step, and the modules entered in all.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_ascend_chunk"
PLAN = (str(PACKAGE / "scheduler" / "coordinator.py"), "plan")


class StepModules:
    def __init__(self) -> None:
        self.steps: list[set[str]] = []
        self._step: set[str] = set()

    def profile(self, frame, event: str, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(str(PACKAGE)):
            return
        if (code.co_filename, code.co_name) == PLAN:
            self.end_step()
        self._step.add(str(Path(code.co_filename).relative_to(PACKAGE)))

    def end_step(self) -> None:
        if self._step:
            self.steps.append(self._step)
        self._step = set()

    def summary(self) -> str:
        self.end_step()
        if not self.steps:
            return "step modules: no step (no call of ChunkCacheCoordinator.plan)"
        sizes = [len(step) for step in self.steps]
        return (
            f"step modules: {len(sizes)} steps, mean {statistics.mean(sizes):.1f}, max {max(sizes)}, "
            f"{len(set().union(*self.steps))} modules in all"
        )


_modules = StepModules()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    sys.setprofile(_modules.profile)
    try:
        return (yield)
    finally:
        sys.setprofile(None)
        _modules.end_step()  # a test's last step ends with it


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(_modules.summary())
