"""RemoteStoreStats: what a worker's remote-store client counted since it started (reported to the
scheduler with every change, summed over the workers into the `remote_*` counters)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RemoteStoreStats:
    """Running counters since the client started. Every get counts once: a hit, a miss (`absent`,
    `incomplete`, `timeouts`, `get_drops`, `get_store_down`, `get_errors`), `corrupt` or
    `rejected`; every put once: `puts`, `put_skips`, a drop (`put_queue_full`, `put_store_down`,
    `put_store_full`, `put_encode_errors`) or `put_errors`."""

    hits: int = 0
    absent: int = 0
    """Gets that found no object."""
    incomplete: int = 0
    """Gets that found an incomplete object (a part lost, or parts of two writes): removed."""
    timeouts: int = 0
    """Gets not done within `timeout_s` of their start."""
    get_drops: int = 0
    """Gets cancelled by the caller before their read started, or refused because `read_queue`
    gets were waiting."""
    get_store_down: int = 0
    """Gets refused at once, or waiting when it went down: the store down or closing."""
    get_errors: int = 0
    """Gets the store failed: an error code or an exception."""
    corrupt: int = 0
    """Gets of objects that failed to decode: without a secret any (garbage, truncated, foreign);
    with one, objects it verified (their size or checksum wrong)."""
    rejected: int = 0
    """Gets of objects not signed by the secret for the entry asked for (garbage, unsigned, another
    key's, forged, altered, replayed), with a secret set."""
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    put_skips: int = 0
    """Puts of objects already present."""
    put_queue_full: int = 0
    """Puts dropped because the write queue was over its byte bound."""
    put_store_down: int = 0
    """Puts dropped because the store was down (or closing), when queued or when written."""
    put_store_full: int = 0
    """Puts the store had no room for (Mooncake's no-space answer)."""
    put_encode_errors: int = 0
    """Puts dropped because the K/V did not match its header."""
    put_errors: int = 0
    """Puts the store failed: an error code or an exception."""

    @property
    def misses(self) -> int:
        """Gets that brought no object, but for corrupt and rejected ones and store failures."""
        return self.absent + self.incomplete + self.timeouts + self.get_drops

    @property
    def errors(self) -> int:
        """Gets and puts that failed because of the store: error codes, exceptions, store down."""
        return self.get_errors + self.get_store_down + self.put_errors

    @property
    def put_drops(self) -> int:
        """Puts dropped: queue full, store down or full, or K/V not matching its header."""
        return self.put_queue_full + self.put_store_down + self.put_store_full + self.put_encode_errors
