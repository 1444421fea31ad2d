"""What the remote store's scheduler side asks of its workers in a step (`RemoteJobs`), and what
each worker rank reports back (`RemoteReport`): the tier's values in `core.step`."""

from __future__ import annotations

from dataclasses import dataclass, field

NAME = "remote"
"""The tier's name: the key of its jobs and reports in the step metadata."""


@dataclass
class RemoteRead:
    """Read the entry `key` from the remote store into pool `rows` (one per token)."""

    read_id: int
    key: bytes
    rows: list[int]


@dataclass
class RemoteWrite:
    """Write the entry `key`, held in pool `rows`, to the remote store."""

    key: bytes
    rows: list[int]


@dataclass
class RemoteJobs:
    reads: list[RemoteRead] = field(default_factory=list)
    """Entries the store fills (`Fill.LATER`), read into their pool rows from this step on."""
    writes: list[RemoteWrite] = field(default_factory=list)
    """Entries completed by this step's saves, written to the store after them."""


@dataclass
class RemoteReport:
    """One worker rank's news since its last report."""

    reads: dict[int, bool] = field(default_factory=dict)
    """`RemoteRead.read_id` → whether the rank's shard of the entry is now in the pool rows."""
    up: bool | None = None
    """Whether its store is reachable (None: no news)."""
    counters: dict[str, int] | None = None
    """Its store's running counters (`RemoteStore.stats`; None: no news)."""
