"""A stand-in for Mooncake's client class, loaded in the client process by
`tests/unit/test_mooncake_clients.py` (stdlib only: the child imports it)."""

from __future__ import annotations

import os
import threading
import time


class StubClient:
    """Answers with what it was given and where it runs."""

    live = 0
    """Instances not yet released in this process."""

    def __init__(self) -> None:
        StubClient.live += 1

    def __del__(self) -> None:
        StubClient.live -= 1

    def echo(self, value: bytes) -> bytes:
        return bytes(value)

    def where(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "sid": os.getsid(0),
            "cpus": sorted(os.sched_getaffinity(0)),
            "tid": threading.get_native_id(),
        }

    def count(self) -> int:
        return StubClient.live

    def fail(self) -> None:
        raise ValueError("the stub failed")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def close(self) -> None:
        pass
