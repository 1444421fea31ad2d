"""Faults of a shared Mooncake Store injected while a workload runs (`benchmarks/soak_tiers.py`,
`tools/fuzz/soak.py`): the master killed and started again (its index, so every object, lost),
the store process paused, a part of about half of the objects removed (as Mooncake may evict one
part alone), and a slow store (paused and resumed in short bursts). Each fault of a plan runs
once a number of requests have been answered, in a thread beside the workload, and is recorded.

    plan = fault_plan(1000, {"master": 1 / 3, "pause": 1 / 2, "parts": 2 / 3})
    with FaultInjector(store, plan, answered=lambda: done[0]) as faults:
        ...  # the workload
    faults.records  # [{"kind": "master", "what": ..., "after_requests": 333, ...}, ...]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from harness.mooncake_store import MooncakeProcs

SECOND_PARTS = r"^chunk-cache/v\d+/[0-7][^/]*/[^/]+/part1$"
"""Object names of the second part of about half of the objects (keys whose hash starts 0-7)."""

FAULTS = {
    "master": "master killed and restarted",
    "pause": "store paused",
    "parts": "a part of about half of the objects removed",
    "slow": "slow store (paused and resumed in bursts)",
}
"""The kinds of fault, and what each does."""


@dataclass(frozen=True)
class FaultSettings:
    """How long and how hard each fault is."""

    master_down_s: float = 1.0
    """Seconds the master stays down before it is started again."""
    pause_s: float = 4.0
    """Seconds the store process is paused."""
    slow_s: float = 8.0
    """Seconds the store is slow ..."""
    slow_stop_s: float = 0.3
    """... paused this long ..."""
    slow_run_s: float = 0.2
    """... then running this long, again and again."""


@dataclass(frozen=True)
class Fault:
    """A fault of `kind` (`FAULTS`) once `after_requests` requests have been answered."""

    after_requests: int
    kind: str


def fault_plan(requests: int, fractions: Mapping[str, float]) -> list[Fault]:
    """The faults at `fractions` of a run of `requests` (kind → fraction), in order."""
    if unknown := set(fractions) - set(FAULTS):
        raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(FAULTS)}")
    return sorted(
        (Fault(int(requests * f), kind) for kind, f in fractions.items()), key=lambda f: f.after_requests
    )


def fault_action(store: MooncakeProcs, kind: str, settings: FaultSettings) -> Callable[[], dict]:
    """The action of a fault of `kind` on `store`; it returns what to record besides the time."""
    if kind == "master":
        return lambda: store.restart_master(settings.master_down_s) or {}
    if kind == "pause":
        return lambda: store.pause_for(settings.pause_s) or {}
    if kind == "parts":
        return lambda: {"parts_removed": store.remove_objects(SECOND_PARTS)}
    if kind == "slow":
        return lambda: {"pauses": store.slow_for(settings.slow_s, settings.slow_stop_s, settings.slow_run_s)}
    raise ValueError(f"unknown fault {kind!r}; known: {sorted(FAULTS)}")


class FaultInjector:
    """Runs `plan` on `store` in a thread while a workload runs: each fault once `answered()`
    reaches its `after_requests`. Leaving the `with` block (the workload is over) waits for a fault
    under way and skips the faults not started (listed in `skipped`)."""

    def __init__(
        self,
        store: MooncakeProcs,
        plan: list[Fault],
        answered: Callable[[], int],
        settings: FaultSettings | None = None,
        log: Callable[[str], None] = lambda message: print(message, flush=True),
    ) -> None:
        self.store = store
        self.plan = plan
        self.answered = answered
        self.settings = settings or FaultSettings()
        self.log = log
        self.records: list[dict] = []
        self.skipped: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-faults", daemon=True)

    def __enter__(self) -> FaultInjector:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        for i, fault in enumerate(self.plan):
            while self.answered() < fault.after_requests and not self._stop.is_set():
                self._stop.wait(0.05)
            if self._stop.is_set():  # the workload ended first
                self.skipped = [{"after_requests": f.after_requests, "kind": f.kind} for f in self.plan[i:]]
                return
            answered = self.answered()
            self.log(f"fault after {answered} requests: {FAULTS[fault.kind]}")
            start = time.perf_counter()
            info = fault_action(self.store, fault.kind, self.settings)()
            self.records.append(
                {
                    "after_requests": fault.after_requests,
                    "answered": answered,
                    "answered_when_over": self.answered(),
                    "kind": fault.kind,
                    "what": FAULTS[fault.kind],
                    "seconds": round(time.perf_counter() - start, 3),
                    **info,
                }
            )
