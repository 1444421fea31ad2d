"""Where a worker's Mooncake clients run: a child process with a session of its own.

A Mooncake call stuck in a stopped store process busy-polls its thread's core (`calls`). On a
small machine a thread spinning in the server's scheduling group slowed decoding 2-5x, at nice 19
and in the idle class alike, while the same busy loop in a process of another session cost
nothing measurable (`docs/operator/tiers.md`, a paused store: with autogroup, Linux schedules each
session as a group). So the clients live in `python -m vllm_ascend_chunk.tiers.mooncake.clients`,
started with `setsid`, bound to the CPUs the worker's thread is not bound to, its calls run by
`calls.Calls` there; the worker's reader, writer and connector threads call them over a socket
pair and wait for the answer without spinning.

The child exits when the worker closes it or is gone (the end of its socket, or a new parent
process). A child that died fails its calls in flight with `ClientProcessError` (the store counts
them as store errors) and is replaced by the next `new`. Byte arguments and results travel out of
band (pickle protocol 5): one copy each way, through the socket.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import logging
import os
import pickle
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from vllm_ascend_chunk.tiers.mooncake.calls import Calls, run_on

logger = logging.getLogger("vllm.chunk_cache")

MOONCAKE_CLIENT = "mooncake.store:MooncakeDistributedStore"
_COUNT = struct.Struct("<I")
"""Each message: the number of its out-of-band buffers and its pickle, then those buffers."""
_PARENT_CHECK_S = 1.0
_CLOSE_WAIT_S = 5.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
"""Where `vllm_ascend_chunk` is imported from: the child imports it from there too."""


class ClientProcessError(RuntimeError):
    """The client process is gone (or did not start): the call did not run, or its answer is lost."""


class ClientLoadError(RuntimeError):
    """The client process could not load the client class (the message says why)."""


def _send(conn: Connection, lock: threading.Lock, message: tuple) -> None:
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    with lock:
        conn.send_bytes(_COUNT.pack(len(buffers)) + head)
        for buffer in buffers:
            conn.send_bytes(buffer.raw())


def _recv(conn: Connection) -> Any:
    first = conn.recv_bytes()
    (count,) = _COUNT.unpack_from(first)
    buffers = [conn.recv_bytes() for _ in range(count)]
    return pickle.loads(memoryview(first)[_COUNT.size :], buffers=buffers)


def _out_of_band(value: Any) -> Any:
    """Bytes-like values as buffers that travel beside the pickle, not copied into it."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return pickle.PickleBuffer(value)
    return value


class ClientProcess:
    """Clients of `client_class` ("module:attr") in a child process (see the module): `new()` makes
    one, whose method calls run there; a child that exited is replaced by the next `new`.
    Raises `ClientLoadError` if the class cannot be loaded, `ClientProcessError` if the child
    does not start within `start_s`."""

    def __init__(
        self, client_class: str, stuck_s: float, cpus: frozenset[int] | None, start_s: float = 60.0
    ) -> None:
        self._args = (client_class, stuck_s, cpus, start_s)
        self._lock = threading.Lock()
        self._closed = False
        self._child = _Child(*self._args)

    @property
    def pid(self) -> int:
        """The current child's process id."""
        return self._child.pid

    def new(self) -> Any:
        """A new client (not set up) in the child, started again if it exited."""
        with self._lock:
            if self._closed:
                raise ClientProcessError("Chunk Cache remote store: the Mooncake client process is closed")
            if not self._child.alive:
                logger.warning(
                    "Chunk Cache remote store: the Mooncake client process exited (%s); starting another",
                    self._child.exit_status(),
                )
                self._child = _Child(*self._args)
            child = self._child
        return child.new_client()

    def close(self) -> None:
        """Ends the child (its clients should be closed first); its calls in flight fail."""
        with self._lock:
            self._closed = True
        self._child.close()


class _Child:
    """One child process and the thread that reads its answers."""

    def __init__(
        self, client_class: str, stuck_s: float, cpus: frozenset[int] | None, start_s: float
    ) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        cpu_list = ",".join(map(str, sorted(cpus))) if cpus else "-"
        with theirs:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __name__,
                    client_class,
                    repr(stuck_s),
                    cpu_list,
                    str(os.getpid()),
                    str(theirs.fileno()),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.pid = self._proc.pid
        self._cpus = cpus
        self._sock = ours
        self._conn = Connection(os.dup(ours.fileno()))
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, Future[Any]] = {}
        self._ids = itertools.count()
        self._dropped: queue.SimpleQueue[int] = queue.SimpleQueue()
        """Clients no one holds any more (appended by their finalizers, which may run anywhere)."""
        self.alive = True
        try:
            ready = _recv(self._conn) if self._conn.poll(start_s) else ("late",)
        except (EOFError, OSError):
            ready = ("exited",)
        self._reader = threading.Thread(
            target=self._read_answers, name="chunk-cache-mooncake-answers", daemon=True
        )
        if ready[0] == "ready":
            self._reader.start()
            return
        self.close()
        if ready[0] == "error":
            raise ClientLoadError(ready[1])
        if ready[0] == "late":
            raise ClientProcessError(
                f"Chunk Cache remote store: the Mooncake client process did not start within {start_s:g} s"
            )
        raise self._exited()

    def new_client(self) -> _Client:
        with self._lock:
            client = _Client(self, next(self._ids))
        self.call(client.id, "__new__", ())
        # A client no one holds any more is dropped in the child too: it is released there when
        # its last call returns, as it would be in this process.
        weakref.finalize(client, self._dropped.put, client.id)
        return client

    def call(self, client_id: int, method: str, args: tuple) -> Any:
        future: Future[Any] = Future()
        with self._lock:
            if not self.alive:
                raise self._exited()
            call_id = next(self._ids)
            self._pending[call_id] = future
        try:
            for gone in _drain(self._dropped):
                _send(self._conn, self._send_lock, (None, gone, "__drop__", ()))
            _send(self._conn, self._send_lock, (call_id, client_id, method, tuple(map(_out_of_band, args))))
        except OSError:
            self._gone()
        return future.result()

    def _exited(self) -> ClientProcessError:
        return ClientProcessError(
            f"Chunk Cache remote store: the Mooncake client process exited ({self.exit_status()})"
        )

    def exit_status(self) -> str:
        rc = self._proc.poll()
        return "running" if rc is None else f"exit status {rc}"

    def close(self) -> None:
        with contextlib.suppress(OSError):  # OSError: it is gone already
            self._sock.shutdown(socket.SHUT_RDWR)  # the child reads the end of its socket and exits
        try:
            self._proc.wait(_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._reader.is_alive():  # it reads the end of the socket: its descriptor can close
            self._reader.join()
        self._gone()
        self._sock.close()
        self._conn.close()

    def _read_answers(self) -> None:
        run_on(self._cpus)  # off the worker's compute cores, as the child: it wakes for every answer
        while True:
            try:
                call_id, ok, value = _recv(self._conn)
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.pop(call_id, None)
            if future is None:  # failed by `close` meanwhile
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(value))
        self._gone()

    def _gone(self) -> None:
        """The child is gone or going: the calls waiting for it fail."""
        with self._lock:
            self.alive = False
            pending, self._pending = self._pending, {}
        if pending:
            error = self._exited()
            for future in pending.values():
                future.set_exception(error)


def _drain(items: queue.SimpleQueue[int]) -> list[int]:
    drained = []
    while True:
        try:
            drained.append(items.get_nowait())
        except queue.Empty:
            return drained


class _Client:
    """A client in the child process: each method call runs there, and blocks until it answers."""

    def __init__(self, child: _Child, client_id: int) -> None:
        self._child = child
        self.id = client_id

    def __getattr__(self, method: str) -> Any:
        return lambda *args: self._child.call(self.id, method, args)


# The child.


def _serve(conn: Connection, lock: threading.Lock, client_class: type, calls: Calls) -> None:
    """Runs the calls that arrive on `conn` (`lock` guards its sends) until its end, then exits
    the process at once: a call may still be stuck in the Mooncake client, whose threads would
    abort a normal exit."""
    clients: dict[int, Any] = {}

    def answer(call_id: int, future: Future[Any]) -> None:
        try:
            reply = (call_id, True, _out_of_band(future.result()))
        except BaseException as e:  # the parent raises it in the caller
            reply = (call_id, False, repr(e))
        try:
            _send(conn, lock, reply)
        except OSError:  # the worker is gone
            os._exit(0)

    while True:
        try:
            call_id, client_id, method, args = _recv(conn)
        except (EOFError, OSError):
            os._exit(0)
        if method == "__drop__":
            clients.pop(client_id, None)
            continue
        try:
            if method == "__new__":
                clients[client_id] = client_class()
                future: Future[Any] = Future()
                future.set_result(None)
            else:
                if client_id not in clients:
                    raise ValueError(f"client {client_id} is closed")
                client = clients.pop(client_id) if method == "close" else clients[client_id]
                future = calls.submit(getattr(client, method), *args)
        except Exception as e:  # no such client or method, or the class raised
            future = Future()
            future.set_exception(e)
        future.add_done_callback(functools.partial(answer, call_id))


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_CHECK_S)
    os._exit(0)


def _load(spec: str) -> type:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def main(argv: list[str]) -> None:
    client_class, stuck_s, cpu_list, parent, fd = argv
    conn = Connection(int(fd))
    cpus = None if cpu_list == "-" else frozenset(map(int, cpu_list.split(",")))
    run_on(cpus)  # first: the threads started below inherit it
    send_lock = threading.Lock()
    try:
        loaded = _load(client_class)
    except Exception as e:  # ImportError, or a broken library: the parent fails start-up with it
        _send(conn, send_lock, ("error", f"{type(e).__name__}: {e}"))
        return
    threading.Thread(target=_exit_when_orphaned, args=(int(parent),), daemon=True).start()
    _send(conn, send_lock, ("ready",))
    _serve(conn, send_lock, loaded, Calls(float(stuck_s), cpus))


if __name__ == "__main__":
    main(sys.argv[1:])
