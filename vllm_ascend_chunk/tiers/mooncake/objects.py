"""The object protocol of the remote store, over a Mooncake Store client (no threads, no state):
multi-part objects, their removal, and the probe that tells whether the store works.

Objects larger than `part_bytes` are stored in parts: `name`, `name/part1`, ... Each part starts
with a random nonce drawn per write; parts 1.. are written first, `name` last. A reader that finds
a part missing (Mooncake evicts parts independently) or a part whose nonce is not `name`'s (two
writers raced) has a miss and removes `name`: the next writer of the entry (it checks only `name`)
writes the whole object again. A reader never gets the bytes of a mixed or partial object.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.chunk_cache")

PROBE_NAME = "chunk-cache/probe"
PROBE_VALUE = b"chunk-cache probe object\n"
NO_SPACE = -200
"""Mooncake's NO_AVAILABLE_HANDLE: the store has no room for the object."""
NONCE_BYTES = 8
"""Each part of a multi-part object starts with its write's nonce."""
_PROBE_RETRY_S = 0.05
"""How often a probe tries again to write or read its object, until its timeout."""


class Fetched(enum.Enum):
    """Why `fetch` returned no bytes."""

    ABSENT = "absent"
    FAILED = "failed"
    """The store answered with an error (the object exists but could not be read)."""
    INCOMPLETE = "incomplete"
    """A part lost, or parts of two writes: the object was removed."""
    ABANDONED = "abandoned"
    """The caller gave up on it between parts."""


def part_names(name: str, size: int, part_bytes: int) -> list[str]:
    """The objects an object of `size` bytes is stored as: `name`, then `name/part<i>` (each
    part but a lone one carries `NONCE_BYTES` more)."""
    count = 1 if size <= part_bytes else -(-size // (part_bytes - NONCE_BYTES))
    return [name, *(f"{name}/part{i}" for i in range(1, count))]


def put_parts(client: Any, name: str, blob: bytes, part_bytes: int) -> int:
    """Put `blob` as its parts, the first one (`name`, what readers look for) last; the first
    nonzero return code (the parts written are removed then), or 0."""
    names = part_names(name, len(blob), part_bytes)
    if len(names) == 1:
        return client.put(name, blob)
    # Upserts: a part left by an earlier write of this name (its first part evicted or removed)
    # is replaced, not kept, as `put` would.
    step, view, nonce = part_bytes - NONCE_BYTES, memoryview(blob), os.urandom(NONCE_BYTES)
    for n, i in enumerate([*range(1, len(names)), 0]):
        if rc := client.upsert_parts(names[i], nonce, view[i * step : (i + 1) * step]):
            for j in range(1, 1 + n):  # complete or absent
                remove(client, names[j])
            return rc
    return 0


def fetch(
    client: Any, name: str, size: int, part_bytes: int, abandoned: Callable[[], bool]
) -> bytes | memoryview | tuple[Fetched, str]:
    """The bytes of the object `name` of `size` bytes, or why not (and, for a failure, what the
    store said). Raises whatever the Mooncake binding raises."""
    names = part_names(name, size, part_bytes)
    first = client.get(name)
    if not first:
        # Mooncake answers b"" for absent objects and for failures alike.
        present = client.is_exist(name)
        return (Fetched.ABSENT, "") if present == 0 else (Fetched.FAILED, f"exists: {present}")
    if len(names) == 1:
        return first
    parts = [memoryview(first)]
    for part in names[1:]:
        if abandoned():  # past its deadline: no more transfers for it
            return Fetched.ABANDONED, ""
        parts.append(memoryview(client.get(part)))
    nonce = parts[0][:NONCE_BYTES]
    if not all(len(p) > NONCE_BYTES and p[:NONCE_BYTES] == nonce for p in parts):
        remove(client, name)  # rewritable by the next writer
        return Fetched.INCOMPLETE, ""
    return b"".join(p[NONCE_BYTES:] for p in parts)


def remove(client: Any, name: str) -> None:
    """Remove the object `name` (its first part: what writers check), so that the next writer
    of the entry writes it again. Forced: this reader's own lease on it does not stop it."""
    try:
        client.remove(name, True)
    except Exception:  # best effort: a failure here leaves a miss, never wrong KV
        logger.debug("Chunk Cache remote store: removing %r failed", name, exc_info=True)


def reachable(address: str, timeout_s: float) -> bool:
    """Whether something listens at `host:port`."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError):
        return False
    return True


def probe(client: Any, master: str, connect_s: float, timeout_s: float) -> str | None:
    """Why the store does not work now, or None: the master is reachable and answers, and the
    probe object (written first where absent) reads back within `timeout_s`. Only the object read
    back shows that the store answers: a write refused for no space is retried until then (a full
    store evicts within milliseconds; a stopped store process, whose memory the master dropped,
    never takes it)."""
    if not reachable(master, connect_s):
        return f"no master listening at {master}"
    start = time.monotonic()
    while True:
        try:
            present = client.is_exist(PROBE_NAME)
            if present < 0:
                return f"the master does not answer (exists: {present})"
            rc = client.put(PROBE_NAME, PROBE_VALUE) if present == 0 else 0
            if rc not in (0, NO_SPACE):
                return f"writing the probe object failed ({rc})"
            if rc == 0 and client.get(PROBE_NAME) == PROBE_VALUE:
                break
        except Exception as e:  # the Mooncake binding: whatever it raises is a store error
            return f"the probe raised {e!r}"
        # No room for it, or it could not be read (stuck, or evicted since the check).
        if time.monotonic() - start >= timeout_s:
            why = "the store has no room for the probe object" if rc else "reading the probe object failed"
            return f"{why} (for {timeout_s:g} s)"
        time.sleep(_PROBE_RETRY_S)
    took = time.monotonic() - start
    if took > timeout_s:
        return f"the probe took {took:.1f} s"
    return None


MOONCAKE_TCP_BOUNDS = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
"""The environment variables that bound a Mooncake TCP transfer, in seconds."""


def bound_mooncake_transfers(timeout_s: float) -> None:
    """Mooncake's TCP transfers bounded by a second more than `timeout_s` (process-wide, unless
    already set). The margin lets a read's own deadline settle a stalled get first,
    as a timeout: at the same bound, a busy machine could let the transfer fail first, as an
    error. The bound frees the reader thread."""
    seconds = str(math.ceil(timeout_s) + 1)
    for name in MOONCAKE_TCP_BOUNDS:
        os.environ.setdefault(name, seconds)
    # One attempt per `setup`; the connector thread does the retrying.
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
