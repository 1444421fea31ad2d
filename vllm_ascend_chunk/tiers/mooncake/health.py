"""Whether the remote store works: a worker's Mooncake client, connected and reconnected by a
thread of its own, which probes the store when an operation failed (only a failed probe is an
outage; `objects.probe`) and logs one warning per outage and one line when it is back."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from vllm_ascend_chunk.config.settings import RemoteConfig
from vllm_ascend_chunk.tiers.mooncake.objects import PROBE_NAME, probe, reachable

logger = logging.getLogger("vllm.chunk_cache")


class Clients(Protocol):
    """Where Mooncake clients are made (`clients.ClientProcess`)."""

    def new(self) -> Any:
        """A new client, not set up."""

    def close(self) -> None:
        """No more clients (the ones made should be closed first)."""


class StoreConnection:
    def __init__(
        self,
        config: RemoteConfig,
        hostname: str,
        clients: Clients,
        lock: threading.Lock,
        closed: threading.Event,
        on_outage: Callable[[], None],
    ) -> None:
        self.config = config
        self._hostname = hostname
        self._clients = clients
        self._lock = lock
        """The store's lock: guards `up` and the suspicion with the store's own state."""
        self._closed = closed
        self._on_outage = on_outage
        """Called when the store goes down (the store resolves the reads waiting for it)."""
        self.client: Any = None
        """A mooncake.store.MooncakeDistributedStore (made by `clients`)."""
        self.up = False
        """Connected, and the last probe of the store succeeded."""
        self._ever_up = False
        self._outage_logged = False
        self._suspect: str | None = None
        """Why the store should be probed now (an operation failed), if it should."""
        self._wake = threading.Event()
        """Wakes the connector: an operation failed, or the store closes."""
        self._settled = threading.Event()
        """Clear from a suspicion until the probe it calls for has decided (`hold_reads`)."""
        self._settled.set()
        self._tried = threading.Event()
        """Set once the first connection attempt has ended (connected or not)."""
        self._thread = threading.Thread(target=self._loop, name="chunk-cache-remote-connect", daemon=True)

    def start(self, wait_s: float) -> None:
        """Starts the connector thread and waits (at most `wait_s`) for its first attempt: a
        store that can be reached is up before the engine's first request."""
        self._thread.start()
        self._tried.wait(wait_s)

    def wake(self) -> None:
        """Wakes the connector thread (the store is closing)."""
        self._wake.set()

    def hold_reads(self, timeout_s: float) -> None:
        """Returns once no probe is pending (at most `timeout_s`): a read started while the store
        is suspect would likely hang in it, and a read stuck in a stopped store process keeps a
        core busy in the Mooncake client until its transfer times out."""
        self._settled.wait(timeout_s)

    def stop(self) -> Any:
        """Ends the connector thread (after the store's `closed` is set); the client, now no one's."""
        self._settled.set()
        self._wake.set()
        self._thread.join()
        with self._lock:
            client, self.client, self.up = self.client, None, False
        return client

    def operation_failed(self, reason: str) -> None:
        """An operation failed (or the store had no room): the connector probes the store (only a
        failed probe is an outage)."""
        with self._lock:
            if not self.up or self._closed.is_set():
                return
            self._suspect = self._suspect or reason
            self._settled.clear()
        self._wake.set()

    def suspect_locked(self, reason: str) -> None:
        """`operation_failed`, the store's lock held, the store up."""
        self._suspect = self._suspect or reason
        self._settled.clear()
        self._wake.set()

    def failed(self, reason: str) -> None:
        with self._lock:
            self.up = False
            first = not self._outage_logged
            self._outage_logged = True
            self._suspect = None
            self._settled.set()  # down: reads are refused at once, none waits
        self._on_outage()
        if first:
            logger.warning(
                "Chunk Cache remote store (Mooncake master %s) unavailable: %s; remote reads "
                "miss and writes are dropped until it is back (retrying every %g s)",
                self.config.master,
                reason,
                self.config.retry_s,
            )

    def _connected(self) -> None:
        with self._lock:
            self.up = True
            self._suspect = None
            self._settled.set()
            again, self._ever_up = self._ever_up, True
            self._outage_logged = False
        logger.info(
            "Chunk Cache remote store %s Mooncake master %s",
            "is back:" if again else "connected to",
            self.config.master,
        )

    def _loop(self) -> None:
        while not self._closed.is_set():
            if not self.up:
                try:
                    self._reconnect()
                except Exception as e:  # the Mooncake binding: this thread must go on retrying
                    self.failed(f"connecting raised {e!r}")
                self._tried.set()
            elif self._suspect is not None:
                with self._lock:
                    suspect, self._suspect = self._suspect, None
                if (failure := self._probe(self.client)) is not None:
                    self.failed(f"{failure}, after {suspect}")
                with self._lock:
                    if self._suspect is None:  # no new suspicion meanwhile
                        self._settled.set()
            self._wake.wait(self.config.retry_s)
            self._wake.clear()

    def _probe(self, client: Any) -> str | None:
        return probe(client, self.config.master, min(1.0, self.config.retry_s), self.config.timeout_s)

    def _reconnect(self) -> None:
        if not reachable(self.config.master, min(1.0, self.config.retry_s)):
            self.failed(f"no master listening at {self.config.master}")
            return
        client = self.client
        # The Mooncake client reconnects to a restarted master by itself: a new one only when the
        # master does not answer this one (or its process is gone).
        if client is None or not _answers(client):
            client = self._clients.new()
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
                self.failed(f"Mooncake client setup returned {rc}")
                return
            if self._closed.is_set():
                client.close()
                return
            # A replaced client is released when the last read still using it returns.
            self.client = client
        if (failure := self._probe(client)) is not None:
            self.failed(failure)
            return
        self._connected()


def _answers(client: Any) -> bool:
    """Whether the master answers `client`."""
    try:
        return client.is_exist(PROBE_NAME) >= 0
    except Exception:  # the Mooncake binding, or its process is gone
        return False
