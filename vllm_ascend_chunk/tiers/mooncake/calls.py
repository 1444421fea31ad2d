"""Mooncake client calls on threads of their own, so that a stuck call costs the machine only the
CPU that no one else wants.

A get or put stuck in a stopped store process busy-polls its calling thread's core inside the
Mooncake client until the transfer gives up (`MC_TCP_*_TIMEOUT_SEC`; the client waits on a
condition variable only when built with `USE_EVENT_DRIVEN_COMPLETION`, which the wheels are not):
a whole core for seconds, which on a small machine slows the forward beside it. `Calls` runs each
call on a thread of a small pool, in the client process (`clients`), off the worker's compute
cores. A call whose thread has spent `stuck_s` of CPU time in it is spinning, and its thread drops
to the lowest priority (nice 19: about 1.5% of a core beside one busy thread), and leaves the pool
when its call returns: an unprivileged process cannot raise a thread back, so the calls after it
run on fresh threads at the normal priority.

Only spinning calls are demoted. A call that is merely slow, as on a machine whose cores engines
keep busy, spends little CPU and keeps its priority: demoting by wall time alone starved the
health probe there, and the store was reported down. Nice 19 rather than the idle scheduling
class: an idle-class thread barely runs while the cores are busy, nor releases what it holds
inside the client, and it bought nothing measurable (`docs/operator/tiers.md`, a paused store).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

logger = logging.getLogger("vllm.chunk_cache")

T = TypeVar("T")
_DEMOTED_NICE = 19
_RECHECK_S = 0.05
"""How often a call past `stuck_s` of wall time that has not spun as long is looked at again."""


def spare_cpus() -> frozenset[int] | None:
    """The CPUs the calling thread is not bound to (vLLM's CPU worker binds its threads to the
    worker's compute cores), or None: it is bound to none, or this is not Linux."""
    if not sys.platform.startswith("linux"):
        return None
    others = frozenset(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
    return others or None


def run_on(cpus: frozenset[int] | None) -> None:
    """The calling thread (and the threads it starts) on `cpus` (None: unchanged)."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # a sandbox may forbid it: the store works, only beside the forward
        logger.debug("Chunk Cache remote store: thread CPUs unchanged (%s)", e)


class _Worker:
    """One pool thread: runs the calls handed to it, one at a time."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.tid: int | None = None
        self.clock: int | None = None
        """The thread's CPU-time clock."""
        self.demoted = False
        threading.Thread(target=self._loop, name="chunk-cache-mooncake-call", daemon=True).start()

    def _loop(self) -> None:
        self.tid = threading.get_native_id()
        if hasattr(time, "pthread_getcpuclockid"):  # Linux; elsewhere no call is demoted
            self.clock = time.pthread_getcpuclockid(threading.get_ident())
        run_on(self.calls.cpus)
        while (job := self.jobs.get()) is not None:
            self.calls._started(self)
            job()
            if not self.calls._returned(self):
                return


class Calls:
    """Runs Mooncake client calls on pool threads, demoting the threads of stuck ones (see the
    module)."""

    def __init__(self, stuck_s: float, cpus: frozenset[int] | None) -> None:
        self.stuck_s = stuck_s
        self.cpus = cpus
        """Where the pool's threads run (`spare_cpus` of the thread that made the store)."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._idle: list[_Worker] = []
        self._running: dict[_Worker, tuple[float, float]] = {}
        """Workers in a call → (when its CPU time is first checked, the thread's CPU time when
        the call began)."""
        self._closed = False
        self._watchdog = threading.Thread(
            target=self._watch, name="chunk-cache-mooncake-watchdog", daemon=True
        )
        self._watchdog.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """`fn(*args)` on a pool thread: a future of what it returns, or of what it raises."""
        future: Future[T] = Future()

        def job() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

        with self._lock:
            if self._closed:
                raise RuntimeError("Chunk Cache remote store: Mooncake calls after close")
            worker = self._idle.pop() if self._idle else None
        (worker or _Worker(self)).jobs.put(job)
        return future

    def close(self) -> None:
        """Ends the idle threads and the watchdog; a thread still in a call ends when it returns."""
        with self._changed:
            self._closed = True
            idle, self._idle = self._idle, []
            self._changed.notify()
        for worker in idle:
            worker.jobs.put(None)
        self._watchdog.join()

    def _started(self, worker: _Worker) -> None:
        """`worker`'s thread begins a call (its CPU time can exceed the wall time it has run)."""
        with self._changed:
            self._running[worker] = (time.monotonic() + self.stuck_s, time.thread_time())
            self._changed.notify()

    def _returned(self, worker: _Worker) -> bool:
        """Whether `worker` takes another call (it is neither demoted nor the pool closed)."""
        with self._lock:
            self._running.pop(worker, None)
            if worker.demoted or self._closed:
                return False
            self._idle.append(worker)
            return True

    def _watch(self) -> None:
        with self._changed:
            while not self._closed:
                now = time.monotonic()
                waits = []
                # A worker in `_running` is in its call, or waits for this lock to leave it: its
                # thread, and so its CPU clock, is alive.
                for worker, (check_at, cpu_at_start) in self._running.items():
                    if worker.demoted or worker.clock is None:
                        continue
                    if check_at > now:
                        waits.append(check_at - now)
                    elif time.clock_gettime(worker.clock) - cpu_at_start >= self.stuck_s:
                        worker.demoted = True
                        _demote(worker.tid, self.stuck_s)
                    else:  # slow but not spinning (a busy machine): look again soon
                        waits.append(_RECHECK_S)
                self._changed.wait(min(waits) if waits else None)


def _demote(tid: int, stuck_s: float) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, tid, _DEMOTED_NICE)  # on Linux: that thread alone
    except (AttributeError, OSError) as e:  # not Linux, or the thread just ended
        logger.debug("Chunk Cache remote store: Mooncake call thread %d not demoted (%s)", tid, e)
        return
    logger.debug(
        "Chunk Cache remote store: a Mooncake call spun %g s of CPU; its thread now runs at nice %d",
        stuck_s,
        _DEMOTED_NICE,
    )
