"""RemoteStore: a worker's client of a shared remote KV tier on Mooncake Store.

Entries' KV travel as `kv_object` blobs under names the caller chooses (the name must say
everything that makes two objects different: entry key, model, rank...; the blob's header is
checked against the reader's expectation, so a wrong name costs a miss, never wrong KV).

Nothing here blocks the caller or raises because of the store: `put` queues the write for a
writer thread (dropped, and counted, when the queue is over its byte bound or the store is down),
`get` returns a future that resolves to the tensor or to `None` for every kind of miss.

Faults:
- Store unreachable at start-up or lost mid-run: `up` turns False and one warning is logged per
  outage; gets resolve to `None` at once, puts are dropped. A connector thread retries every
  `retry_s` (a fresh Mooncake client when the old one does not recover) and logs when it is back.
  Objects written before a master restart may be gone: the master's index does not survive it.
- A slow or stuck store: each get's future resolves to `None` at `timeout_s`. The Mooncake TCP
  transfer itself is bounded by `MC_TCP_PROGRESS_TIMEOUT_SEC` / `MC_TCP_STATUS_TIMEOUT_SEC`, which
  are set (process-wide, unless already set) to `timeout_s` before the first client starts, so
  reader threads are freed too. A call to a dead master returns after ~4 s whatever the settings.
- Garbage, truncated or foreign objects: `None`, counted as `corrupt`, a rate-limited warning.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from vllm_ascend_chunk.worker.kv_object import KVHeader, KVObjectError, decode, encode, object_size

logger = logging.getLogger("vllm.chunk_cache")

_MIB = 1 << 20
_PROBE_NAME = "chunk-cache/probe"
_CORRUPT_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class RemoteStoreConfig:
    """Where the Mooncake Store is and how this client uses it."""

    master: str
    """Master RPC address, "host:port"."""
    metadata_server: str
    """E.g. "http://127.0.0.1:8080/metadata" (the master's embedded HTTP metadata server)."""
    protocol: str = "tcp"
    device_name: str = ""
    segment_bytes: int = 0
    """Memory this client contributes to the store; 0: a separate store process holds the data
    (Mooncake's "standalone-store" mode)."""
    buffer_bytes: int = 64 * _MIB
    """The client's local transfer buffer: one get or put moves at most this much."""
    part_bytes: int = 16 * _MIB
    """Objects larger than this are stored in parts of this size (a buffer holds one part of
    each concurrent transfer: two reads and a write)."""
    timeout_s: float = 5.0
    """Bound on one get."""
    retry_s: float = 5.0
    """Reconnect interval while the store is unreachable."""
    queue_bytes: int = 512 * _MIB
    """Bound on the KV bytes waiting to be written; puts beyond it are dropped."""


@dataclass
class RemoteStoreStats:
    """Running counters since the client started."""

    hits: int = 0
    misses: int = 0
    """Gets of absent objects."""
    corrupt: int = 0
    """Gets of objects that failed to decode (garbage, truncated, foreign)."""
    errors: int = 0
    """Gets and puts that failed because of the store: errors, timeouts, store down."""
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    put_skips: int = 0
    """Puts of objects already present."""
    put_drops: int = 0
    """Puts dropped: queue full, store down, or KV not matching its header."""


class _PendingGet:
    """One get's future; settled once, by the read or by its deadline, whichever comes first."""

    def __init__(self) -> None:
        self.future: Future[torch.Tensor | None] = Future()
        self.settled = False


def _bound_mooncake_transfers(timeout_s: float) -> None:
    seconds = str(max(1, math.ceil(timeout_s)))
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", seconds)
    os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", seconds)
    # One attempt per `setup`; the connector thread does the retrying.
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")


def _mooncake_store_class() -> type:
    """Mooncake's client class; a missing or unloadable package fails start-up, not a thread."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise RuntimeError(
            f"Chunk Cache: a remote store is configured but Mooncake Store cannot be loaded ({e}). "
            "Install it (pip install mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine "
            "on CUDA; it needs libibverbs1 from your distribution even over TCP), or unset "
            "VLLM_CHUNK_CACHE_REMOTE_MASTER."
        ) from e
    return MooncakeDistributedStore


def _reachable(address: str, timeout_s: float) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError):
        return False
    return True


class RemoteStore:
    """A Mooncake Store client with background connection, reads and writes (see the module)."""

    def __init__(self, config: RemoteStoreConfig, *, local_hostname: str = "127.0.0.1") -> None:
        self.config = config
        self._hostname = local_hostname
        self._lock = threading.Lock()
        self._stats = RemoteStoreStats()
        self._client: Any = None  # mooncake.store.MooncakeDistributedStore
        self._up = False
        self._ever_up = False
        self._outage_logged = False
        self._corrupt_logged_at = -math.inf
        self._closed = threading.Event()
        self._queue: queue.SimpleQueue[tuple[str, KVHeader, torch.Tensor, int] | None] = queue.SimpleQueue()
        self._queued_bytes = 0
        _bound_mooncake_transfers(config.timeout_s)
        self._store_class = _mooncake_store_class()
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chunk-cache-remote-get")
        self._writer = threading.Thread(target=self._write_loop, name="chunk-cache-remote-put", daemon=True)
        self._connector = threading.Thread(
            target=self._connect_loop, name="chunk-cache-remote-connect", daemon=True
        )
        self._writer.start()
        self._connector.start()
        # A process that exits without `close` (an offline `LLM` script) would end inside
        # Mooncake's threads: the C++ runtime aborts the process (SIGABRT) on the way out.
        atexit.register(self.close)

    @property
    def up(self) -> bool:
        """Connected, and the last operation succeeded."""
        return self._up

    def stats(self) -> RemoteStoreStats:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._stats)

    def put(self, name: str, header: KVHeader, kv: torch.Tensor) -> None:
        """Queue `kv` (a CPU tensor the store now owns: do not modify it) to be written as `name`,
        unless an object of that name exists. Never blocks on the network, never raises."""
        nbytes = kv.numel() * kv.element_size()
        with self._lock:
            if self._closed.is_set() or not self._up or self._queued_bytes + nbytes > self.config.queue_bytes:
                self._stats.put_drops += 1
                return
            self._queued_bytes += nbytes
        self._queue.put((name, header, kv, nbytes))

    def get(self, name: str, header: KVHeader) -> Future[torch.Tensor | None]:
        """The object `name` as a tensor matching `header`, or `None` (absent, corrupt, foreign,
        store error or down, or not read within `timeout_s`)."""
        pending = _PendingGet()
        client = self._client
        if client is None or not self._up or self._closed.is_set():
            self._settle(pending, None, "errors")
            return pending.future
        deadline = threading.Timer(self.config.timeout_s, self._expire, (pending,))
        deadline.daemon = True
        deadline.start()

        def read() -> None:
            try:
                self._read(client, name, header, pending)
            finally:
                deadline.cancel()

        try:
            self._readers.submit(read)
        except RuntimeError:  # closed meanwhile
            deadline.cancel()
            self._settle(pending, None, "errors")
        return pending.future

    def close(self) -> None:
        """Stop the threads (queued writes are written first; in-flight reads finish or time out)
        and close the Mooncake client. Idempotent; also run at interpreter exit."""
        atexit.unregister(self.close)
        if self._closed.is_set():
            return
        self._closed.set()
        self._queue.put(None)
        self._writer.join()
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._connector.join()
        with self._lock:
            client, self._client, self._up = self._client, None, False
        if client is not None:
            client.close()

    # Reads and writes.

    def _read(self, client: Any, name: str, header: KVHeader, pending: _PendingGet) -> None:
        try:
            blob = client.get(name)
            if blob and (rest := self._part_names(name, object_size(header))[1:]):
                parts = [blob, *(client.get(part) for part in rest)]
                if not all(parts):  # a part evicted, or not written: the object is incomplete
                    self._settle(pending, None, "misses")
                    return
                blob = b"".join(parts)
            if not blob:
                # Mooncake answers b"" for absent objects and for failures alike.
                present = client.is_exist(name)
                if present == 0:
                    self._settle(pending, None, "misses")
                elif present == 1:  # this object's read failed (e.g. its lease expired): not an outage
                    self._settle(pending, None, "errors")
                else:
                    self._read_failed(pending, f"reading {name!r} failed (exists: {present})")
                return
        except Exception as e:  # the Mooncake binding: whatever it raises is a store error
            self._read_failed(pending, f"reading {name!r} raised {e!r}")
            return
        try:
            kv = decode(blob, header)
        except KVObjectError as e:
            self._log_corrupt(name, e)
            self._settle(pending, None, "corrupt")
            return
        self._settle(pending, kv, "hits", len(blob))

    def _expire(self, pending: _PendingGet) -> None:
        self._read_failed(pending, f"a read took over {self.config.timeout_s:g} s")

    def _read_failed(self, pending: _PendingGet, reason: str) -> None:
        # A read already given up on (timed out) says nothing about the store now.
        if not pending.settled and not self._closed.is_set():
            self._failed(reason)
        self._settle(pending, None, "errors")

    def _settle(
        self, pending: _PendingGet, value: torch.Tensor | None, counter: str, nbytes: int = 0
    ) -> bool:
        with self._lock:
            if pending.settled:
                return False
            pending.settled = True
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)
            self._stats.bytes_read += nbytes
        pending.future.set_result(value)
        return True

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            name, header, kv, nbytes = item
            try:
                self._write(name, header, kv)
            finally:
                with self._lock:
                    self._queued_bytes -= nbytes

    def _write(self, name: str, header: KVHeader, kv: torch.Tensor) -> None:
        client = self._client  # also after `close` began: the queue is drained first
        if client is None or not self._up:
            self._count("put_drops")
            return
        try:
            blob = encode(header, kv)
        except ValueError:
            logger.exception("Chunk Cache remote store: not writing %r", name)
            self._count("put_drops")
            return
        try:
            present = client.is_exist(name)
            rc = self._put_parts(client, name, blob) if present == 0 else None
        except Exception as e:  # the Mooncake binding: whatever it raises is a store error
            present, rc = -1, repr(e)
        if present == 1:
            self._count("put_skips")
        elif rc == 0:
            self._count("puts", bytes_written=len(blob))
        else:
            self._failed(f"writing {name!r} failed (exists: {present}, put: {rc})")
            self._count("errors")

    def _part_names(self, name: str, size: int) -> list[str]:
        """The objects an object of `size` bytes is stored as: `name`, then `name/part<i>`."""
        count = max(1, -(-size // self.config.part_bytes))
        return [name, *(f"{name}/part{i}" for i in range(1, count))]

    def _put_parts(self, client: Any, name: str, blob: bytes) -> int:
        """Put `blob` as its parts, the first one (`name`, what readers look for) last; the first
        nonzero return code, or 0."""
        step, view = self.config.part_bytes, memoryview(blob)  # parts as views: no copies
        names = self._part_names(name, len(blob))
        for i in [*range(1, len(names)), 0]:
            if rc := client.put(names[i], view[i * step : (i + 1) * step]):
                return rc
        return 0

    def _count(self, counter: str, bytes_written: int = 0) -> None:
        with self._lock:
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)
            self._stats.bytes_written += bytes_written

    def _log_corrupt(self, name: str, error: KVObjectError) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._corrupt_logged_at < _CORRUPT_LOG_INTERVAL_S:
                return
            self._corrupt_logged_at = now
            total = self._stats.corrupt + 1
        logger.warning(
            "Chunk Cache remote store: ignoring object %r (%s); %d unusable objects so far "
            "(logged at most every %.0f s)",
            name,
            error,
            total,
            _CORRUPT_LOG_INTERVAL_S,
        )

    # Connection.

    def _failed(self, reason: str) -> None:
        with self._lock:
            self._up = False
            first = not self._outage_logged
            self._outage_logged = True
        if first:
            logger.warning(
                "Chunk Cache remote store (Mooncake master %s) unavailable: %s; remote reads "
                "miss and writes are dropped until it is back (retrying every %g s)",
                self.config.master,
                reason,
                self.config.retry_s,
            )

    def _recovered(self) -> None:
        with self._lock:
            self._up = True
            again, self._ever_up = self._ever_up, True
            self._outage_logged = False
        logger.info(
            "Chunk Cache remote store %s Mooncake master %s",
            "is back:" if again else "connected to",
            self.config.master,
        )

    def _connect_loop(self) -> None:
        while not self._closed.is_set():
            if not self._up:
                self._reconnect()
            self._closed.wait(self.config.retry_s)

    def _reconnect(self) -> None:
        if not _reachable(self.config.master, min(1.0, self.config.retry_s)):
            self._failed(f"no master listening at {self.config.master}")
            return
        if self._client is not None and self._client.is_exist(_PROBE_NAME) >= 0:
            self._recovered()  # the Mooncake client reconnects to a restarted master by itself
            return
        client = self._store_class()
        rc = client.setup(
            self._hostname,
            self.config.metadata_server,
            self.config.segment_bytes,
            self.config.buffer_bytes,
            self.config.protocol,
            self.config.device_name,
            self.config.master,
        )
        if rc != 0:
            self._failed(f"Mooncake client setup returned {rc}")
            return
        if self._closed.is_set():
            client.close()
            return
        # A replaced client is released when the last read still using it returns.
        self._client = client
        self._recovered()
