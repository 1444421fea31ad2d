"""RemoteStore: a worker's client of a shared remote KV tier on Mooncake Store.

Entries' KV travel as `kv_object` blobs under names the caller chooses (the name must say
everything that makes two objects different: entry key, model, rank...; the blob's header is
checked against the reader's expectation, so a wrong name costs a miss, never wrong KV).

Nothing here blocks the caller or raises because of the store: `put` queues the write for a
writer thread (dropped, and counted by reason, when the queue is over its byte bound, when the
store is down, then or when the writer gets to it, when the store is full, or when the K/V does
not match its header: `RemoteStoreStats`), `get` queues the read for two reader threads (at most
`read_queue` waiting) and returns a future that resolves to the tensor or to `None` for every kind
of miss; `cancel()` on it before its read starts skips the read. Threads: one writer, two
readers, one deadline watcher and one connector, whatever the number of operations. The Mooncake
client itself runs in a child process of a session of its own (`clients.ClientProcess`), off the
worker's compute cores (where it is bound to some), its calls on `calls.Calls`' threads there: a
read stuck in a stopped store spins its thread's core inside the client, which costs the worker's
scheduling group nothing, and once that thread has spent `STUCK_CALL_S` of CPU time there it drops
to nice 19.

Objects larger than `part_bytes` are stored in parts (`tiers.mooncake.objects`: a reader never returns KV
of a mixed or partial object, and such an object does not outlive its next read). Whether the
store works is `health.StoreConnection`'s to tell.

Faults:
- A new store waits (at most `_FIRST_CONNECT_S`) for its first connection attempt, so that a
  store that can be reached is up for the engine's first request.
- Store unreachable at start-up or lost mid-run: `up` turns False and one warning is logged per
  outage; gets resolve to `None` at once, puts are dropped. A connector thread retries every
  `retry_s` (a fresh Mooncake client when the old one does not recover) and logs when it is back.
  Objects written before a master restart may be gone: the master's index does not survive it.
- An operation that fails (an error code, an exception) counts as an error and makes the connector
  probe the store at once (master reachable and answering, a small probe object, written first
  where absent, read back within `timeout_s`): only a failed probe is an outage. A put refused for
  no space (Mooncake's -200) is dropped (`put_store_full`) and makes the connector probe too: a full
  store passes (it evicts to make room), a stopped store process whose memory the master dropped
  takes no object and fails.
- A slow or stuck store: a get's future resolves to `None` at `timeout_s` after its read started
  (a miss, counted in `timeouts`, not an outage by itself: a stuck store fails the probe). The
  Mooncake TCP transfer itself is bounded by `MC_TCP_PROGRESS_TIMEOUT_SEC` /
  `MC_TCP_STATUS_TIMEOUT_SEC`, which are set (process-wide, unless already set) to a second more
  than `timeout_s` before the first client starts, so reader threads are freed too (the margin
  lets the read's deadline settle it first, as a timeout). A call to a dead master returns after
  ~4 s whatever the settings.
- While the probe that a failed or timed-out operation calls for is pending, readers start no new
  read (`StoreConnection.hold_reads`): it would likely hang too, and a read stuck in a stopped
  store process keeps a core busy in the Mooncake client until its transfer times out. Queued
  reads wait (the caller may cancel them meanwhile) and resolve as store errors if the probe fails.
- An object that is not the one asked for is `None` and removed, so that the next writer of the
  entry writes it again (the name is made of the entry key and the shard, which fix every field of
  the header: such an object is of use to no reader of the name). Without a secret (the store is
  trusted) it counts as `corrupt` (garbage, truncated, another model's or format's, signed), with
  a rate-limited warning. With a secret (`RemoteConfig.secret`) every object is signed, and one
  this client did not sign for this entry (garbage, unsigned, another key's, forged, altered,
  another format's, or a genuine object of another entry: `KVObjectError.rejected`) counts as
  `rejected`, logged once per cause: it is never loaded; a verified object that still fails
  (size, checksum: a writer's bug) counts as `corrupt`.
"""

from __future__ import annotations

import atexit
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from vllm_ascend_chunk.config.settings import RemoteConfig
from vllm_ascend_chunk.tiers.mooncake.calls import spare_cpus
from vllm_ascend_chunk.tiers.mooncake.clients import MOONCAKE_CLIENT, ClientLoadError, ClientProcess
from vllm_ascend_chunk.tiers.mooncake.health import Clients, StoreConnection
from vllm_ascend_chunk.tiers.mooncake.kv_object import (
    KVHeader,
    KVObjectError,
    SigningKey,
    decode,
    encode,
    object_size,
)
from vllm_ascend_chunk.tiers.mooncake.objects import (
    NO_SPACE,
    Fetched,
    bound_mooncake_transfers,
    fetch,
    put_parts,
    remove,
)
from vllm_ascend_chunk.tiers.mooncake.store_stats import RemoteStoreStats

logger = logging.getLogger("vllm.chunk_cache")

_READERS = 2
STUCK_CALL_S = 0.1
"""A Mooncake call whose thread has spent this much CPU time in it is spinning: its thread is
demoted (`calls`). A read of a working store spins for milliseconds; a demoted call still runs,
only at the lowest priority."""
_CORRUPT_LOG_INTERVAL_S = 60.0
_FIRST_CONNECT_S = 10.0
"""How long a new store waits for its first connection attempt (a master that does not answer
takes ~4 s to fail; an unreachable one fails at once): start-up goes on after it either way."""


def _client_process() -> ClientProcess:
    try:
        return ClientProcess(MOONCAKE_CLIENT, STUCK_CALL_S, spare_cpus())
    except ClientLoadError as e:
        raise RuntimeError(
            f"Chunk Cache: a remote store is configured but Mooncake Store cannot be loaded ({e}). "
            "Install it (pip install mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine "
            "on CUDA; it needs libibverbs1 from your distribution even over TCP), or unset "
            "VLLM_CHUNK_CACHE_REMOTE_MASTER."
        ) from e


class _PendingGet:
    """One get's future; settled once, by the read or by its deadline, whichever comes first."""

    def __init__(self, name: str, header: KVHeader) -> None:
        self.name = name
        self.header = header
        self.future: Future[torch.Tensor | None] = Future()
        self.settled = False


class RemoteStore:
    """A Mooncake Store client with background connection, reads and writes (see the module)."""

    def __init__(
        self, config: RemoteConfig, *, local_hostname: str = "127.0.0.1", clients: Clients | None = None
    ) -> None:
        """`clients`: where the Mooncake clients are made (None: a `clients.ClientProcess` of
        Mooncake's client class, started here: a missing or unloadable package fails here)."""
        self.config = config
        self._lock = threading.Lock()
        self._stats = RemoteStoreStats()
        self._corrupt_logged_at = -math.inf
        self._rejected_logged: set[str] = set()
        """The causes (`KVObjectError.reason`) of rejected objects logged so far."""
        self.signing_key = SigningKey(config.secret) if config.secret is not None else None
        """Signs every object written and verifies every object read (None: unsigned)."""
        self._closed = threading.Event()
        self._queue: queue.SimpleQueue[tuple[str, KVHeader, torch.Tensor, int] | None] = queue.SimpleQueue()
        self._queued_bytes = 0
        self._reads: queue.Queue[_PendingGet | None] = queue.Queue()
        self._in_flight: dict[_PendingGet, float] = {}
        """Reads started → their deadlines (watched by one thread)."""
        self._deadlines = threading.Condition(self._lock)
        bound_mooncake_transfers(config.timeout_s)  # before the client process starts: it inherits them
        self._clients = clients or _client_process()
        self._conn = StoreConnection(
            config,
            local_hostname,
            self._clients,
            self._lock,
            self._closed,
            self._drain_reads,
        )
        self._threads = [
            threading.Thread(target=self._read_loop, name=f"chunk-cache-remote-get{i}", daemon=True)
            for i in range(_READERS)
        ]
        self._watcher = threading.Thread(
            target=self._deadline_loop, name="chunk-cache-remote-deadlines", daemon=True
        )
        self._writer = threading.Thread(target=self._write_loop, name="chunk-cache-remote-put", daemon=True)
        for thread in (*self._threads, self._watcher, self._writer):
            thread.start()
        self._conn.start(_FIRST_CONNECT_S)
        # A process that exits without `close` (an offline `LLM` script) would end inside
        # Mooncake's threads: the C++ runtime aborts the process (SIGABRT) on the way out.
        atexit.register(self.close)

    @property
    def up(self) -> bool:
        """Connected, and the last probe of the store succeeded."""
        return self._conn.up

    def stats(self) -> RemoteStoreStats:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._stats)

    def put(self, name: str, header: KVHeader, kv: torch.Tensor) -> None:
        """Queue `kv` (a CPU tensor the store now owns: do not modify it) to be written as `name`,
        unless an object of that name exists. Never blocks on the network, never raises."""
        nbytes = kv.numel() * kv.element_size()
        with self._lock:
            if self._closed.is_set() or not self._conn.up:
                self._stats.put_store_down += 1
                return
            if self._queued_bytes + nbytes > self.config.queue_bytes:
                self._stats.put_queue_full += 1
                return
            self._queued_bytes += nbytes
        self._queue.put((name, header, kv, nbytes))

    def get(self, name: str, header: KVHeader) -> Future[torch.Tensor | None]:
        """The object `name` as a tensor matching `header`, or `None` (absent, incomplete, corrupt,
        foreign, store error or down, not read within `timeout_s` of the read's start, more than
        `read_queue` gets waiting). `cancel()` on the future before the read starts skips it."""
        pending = _PendingGet(name, header)
        if self._conn.client is None or not self._conn.up or self._closed.is_set():
            self._settle(pending, None, "get_store_down")
        elif self._reads.qsize() >= self.config.read_queue:
            self._settle(pending, None, "get_drops")
        else:
            self._reads.put(pending)
        return pending.future

    def close(self) -> None:
        """Stop the threads (queued writes are written first, queued reads resolve to `None`,
        in-flight reads finish or time out) and close the Mooncake client. Idempotent; also run at
        interpreter exit."""
        atexit.unregister(self.close)
        if self._closed.is_set():
            return
        self._closed.set()
        self._conn.wake()
        self._queue.put(None)
        self._writer.join()
        for _ in self._threads:
            self._reads.put(None)
        for thread in self._threads:
            thread.join()
        with self._deadlines:
            self._deadlines.notify()
        self._watcher.join()
        client = self._conn.stop()
        if client is not None:
            client.close()
        self._clients.close()

    # Reads.

    def _read_loop(self) -> None:
        while (pending := self._reads.get()) is not None:
            self._conn.hold_reads(2 * self.config.timeout_s + self.config.retry_s)
            if not pending.future.set_running_or_notify_cancel():  # the caller gave up on it
                self._count("get_drops")
                continue
            client = self._conn.client
            if client is None or not self._conn.up or self._closed.is_set():
                self._settle(pending, None, "get_store_down")
                continue
            with self._deadlines:
                self._in_flight[pending] = time.monotonic() + self.config.timeout_s
                self._deadlines.notify()
            try:
                self._read(client, pending)
            finally:
                with self._deadlines:
                    self._in_flight.pop(pending, None)

    def _deadline_loop(self) -> None:
        """Resolves reads in flight past their deadline (the reader stays in Mooncake until the
        transfer's own timeout; its late result is dropped)."""
        with self._deadlines:
            while not self._closed.is_set() or self._in_flight:
                now = time.monotonic()
                expired = [p for p, deadline in self._in_flight.items() if deadline <= now]
                for pending in expired:
                    del self._in_flight[pending]
                    self._settle_locked(pending, None, ("timeouts",))
                if expired and self._conn.up:  # not a failure yet: the probe tells
                    self._conn.suspect_locked(f"a read took over {self.config.timeout_s:g} s")
                wait = min(self._in_flight.values(), default=now + 1.0) - now
                self._deadlines.wait(max(wait, 0.001))

    def _read(self, client: Any, pending: _PendingGet) -> None:
        name, header = pending.name, pending.header
        try:
            got = fetch(client, name, object_size(header), self.config.part_bytes, lambda: pending.settled)
        except Exception as e:  # the Mooncake binding: whatever it raises is a store error
            self._conn.operation_failed(f"reading {name!r} raised {e!r}")
            self._settle(pending, None, "get_errors")
            return
        if isinstance(got, tuple):
            why, said = got
            if why is Fetched.FAILED:  # e.g. its lease expired, or the store failed
                self._conn.operation_failed(f"reading {name!r} failed ({said})")
                self._settle(pending, None, "get_errors")
            elif why is not Fetched.ABANDONED:  # counted as "absent" or "incomplete"
                self._settle(pending, None, why.value)
            return
        try:
            kv = decode(got, header, self.signing_key)
        except KVObjectError as e:
            if e.rejected:
                self._log_rejected(name, e)
            else:
                self._log_corrupt(name, e)
            remove(client, name)  # of no use to any reader of this name: the next writer replaces it
            self._settle(pending, None, "rejected" if e.rejected else "corrupt")
            return
        self._settle(pending, kv, "hits", nbytes=len(got))

    def _settle(
        self, pending: _PendingGet, value: torch.Tensor | None, *counters: str, nbytes: int = 0
    ) -> bool:
        with self._lock:
            return self._settle_locked(pending, value, counters, nbytes)

    def _settle_locked(
        self, pending: _PendingGet, value: torch.Tensor | None, counters: tuple[str, ...], nbytes: int = 0
    ) -> bool:
        if pending.settled:
            return False
        pending.settled = True
        for counter in counters:
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)
        self._stats.bytes_read += nbytes
        pending.future.set_result(value)  # no callbacks are registered by this package
        return True

    # Writes.

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            name, header, kv, nbytes = item
            try:
                self._write(name, header, kv)
            finally:
                with self._lock:
                    self._queued_bytes -= nbytes

    def _write(self, name: str, header: KVHeader, kv: torch.Tensor) -> None:
        client = self._conn.client  # also after `close` began: the queue is drained first
        if client is None or not self._conn.up:
            self._count("put_store_down")
            return
        try:
            blob = encode(header, kv, self.signing_key)
        except ValueError:
            logger.exception("Chunk Cache remote store: not writing %r", name)
            self._count("put_encode_errors")
            return
        try:
            present = client.is_exist(name)
            rc = put_parts(client, name, blob, self.config.part_bytes) if present == 0 else None
        except Exception as e:  # the Mooncake binding: whatever it raises is a store error
            present, rc = -1, repr(e)
        if present == 1:
            self._count("put_skips")
        elif rc == 0:
            self._count("puts", bytes_written=len(blob))
        elif rc == NO_SPACE:  # full (not a fault), or its memory is gone: the probe tells
            self._count("put_store_full")
            self._conn.operation_failed(f"the store had no room for {name!r}")
        else:
            self._conn.operation_failed(f"writing {name!r} failed (exists: {present}, put: {rc})")
            self._count("put_errors")

    def _count(self, *counters: str, bytes_written: int = 0) -> None:
        with self._lock:
            for counter in counters:
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

    def _log_rejected(self, name: str, error: KVObjectError) -> None:
        with self._lock:
            if error.reason in self._rejected_logged:
                return
            self._rejected_logged.add(error.reason)
        logger.warning(
            "Chunk Cache remote store: refusing object %r, which this instance's secret does not "
            "verify for this entry (%s): a miss, and the object is removed. Someone who can write "
            "to the store without the secret, or an instance with another secret, wrote it, or "
            "someone copied another entry's object here. Further objects refused for this cause "
            "are only counted (vllm:chunk_cache_remote_rejected_total)",
            name,
            error,
        )

    def _drain_reads(self) -> None:
        """The store went down: reads waiting behind readers stuck in it resolve now."""
        while not self._closed.is_set():
            try:
                pending = self._reads.get_nowait()
            except queue.Empty:
                break
            if pending is None:  # `close` began meanwhile: its reader sentinels stay
                self._reads.put(None)
                break
            if pending.future.set_running_or_notify_cancel():
                self._settle(pending, None, "get_store_down")
            else:
                self._count("get_drops")
