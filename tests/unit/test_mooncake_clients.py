"""`tiers.mooncake.clients.ClientProcess`: Mooncake clients in a child process of a session of its
own, here with a stub client class (`tests/helpers/mooncake_stub.py`; `tests/store/` runs the real
one): calls and bytes round-trip, errors come back as errors, a dead child is replaced, and the
child ends with its parent."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from harness.mooncake_store import wait_for
from tests.helpers import REPO
from vllm_ascend_chunk.tiers.mooncake.clients import ClientLoadError, ClientProcess, ClientProcessError

STUB = "tests.helpers.mooncake_stub:StubClient"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sessions and CPU sets")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def clients() -> Iterator[ClientProcess]:
    process = ClientProcess(STUB, 0.1, None)
    yield process
    process.close()


def test_calls_run_in_a_child_of_its_own_session_and_bytes_round_trip(clients: ClientProcess) -> None:
    client = clients.new()
    where = client.where()
    assert where["pid"] == clients.pid != os.getpid()
    assert where["sid"] == clients.pid != os.getsid(0)  # the session's leader
    big = os.urandom(3 << 20)
    assert client.echo(big) == big
    assert client.echo(memoryview(big)[5:17]) == big[5:17]
    assert client.where()["tid"] != os.getpid()  # on a pool thread, not the child's main thread


def test_the_child_runs_on_the_cpus_it_is_given() -> None:
    cpus = frozenset({max(os.sched_getaffinity(0))})
    process = ClientProcess(STUB, 0.1, cpus)
    try:
        assert process.new().where()["cpus"] == sorted(cpus)
    finally:
        process.close()


def test_an_error_in_a_call_is_raised_in_the_caller_and_the_child_goes_on(clients: ClientProcess) -> None:
    client = clients.new()
    with pytest.raises(RuntimeError, match="the stub failed"):
        client.fail()
    with pytest.raises(RuntimeError, match="no_such_method"):
        client.no_such_method()
    assert client.echo(b"still here") == b"still here"


def test_a_closed_client_refuses_calls(clients: ClientProcess) -> None:
    client = clients.new()
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.echo(b"x")


def test_a_client_no_one_holds_is_released_in_the_child(clients: ClientProcess) -> None:
    keep = clients.new()
    dropped = clients.new()
    assert keep.count() == 2
    del dropped
    gc.collect()
    assert keep.count() == 1  # dropped before this call ran


def test_a_killed_child_fails_its_calls_in_flight_and_the_next_client_starts_another(
    clients: ClientProcess,
) -> None:
    client = clients.new()
    first = clients.pid
    errors: list[BaseException] = []

    def stuck() -> None:
        try:
            client.sleep(60)
        except BaseException as e:
            errors.append(e)

    caller = threading.Thread(target=stuck)
    caller.start()
    time.sleep(0.3)
    os.kill(first, signal.SIGKILL)
    caller.join(10)
    assert not caller.is_alive() and isinstance(errors[0], ClientProcessError), errors
    with pytest.raises(ClientProcessError, match="exited"):
        client.echo(b"x")
    again = clients.new()
    assert clients.pid != first and again.echo(b"back") == b"back"


def test_close_ends_the_child(clients: ClientProcess) -> None:
    clients.new()
    pid = clients.pid
    clients.close()
    assert not _running(pid)
    with pytest.raises(ClientProcessError, match="closed"):
        clients.new()


def test_a_class_that_cannot_be_loaded_fails_at_start() -> None:
    with pytest.raises(ClientLoadError, match="ModuleNotFoundError: No module named 'no_such_module'"):
        ClientProcess("no_such_module:Client", 0.1, None)


def test_the_child_ends_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\n"
                "from vllm_ascend_chunk.tiers.mooncake.clients import ClientProcess\n"
                f"p = ClientProcess({STUB!r}, 0.1, None)\n"
                "p.new()\n"
                "print(p.pid, flush=True)\n"
                "time.sleep(60)\n"
            ),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child = int(parent.stdout.readline())
        assert _running(child)
        parent.kill()
        parent.wait()
        wait_for(lambda: not _running(child), 10, "the child exited")
    finally:
        parent.kill()
        parent.stdout.close()
