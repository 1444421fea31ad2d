"""The tiers below the device pool, behind one interface (after vLLM's `OffloadingManager`).

A key missing from the pool is offered to each tier in order (`ChunkCacheManager.tiers`): the
first that has a copy fills the new entry, either with the step being built (`Fill.NOW`: the
host tier's row copies; the entry is resident at once) or asynchronously (`Fill.LATER`: the
remote store's read; the entry is FETCHING until `ChunkCacheManager.fetched` says how it ended).
An entry evicted from the pool is offered to every tier (`prepare_store`). A new backend is one
class with these methods and the manager needs no edits (`tests/helpers/memory_tier.py` is one,
used by the manager's random operation test); an asynchronous one that the workers fill still
needs the coordinator to send its reads, as it sends the remote store's (`RemoteReads.send`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vllm_ascend_chunk.scheduler.manager import Entry


class Fill(enum.Enum):
    """How a tier fills a new pool entry (`Tier.prepare_load`)."""

    ABSENT = "absent"
    """It has no copy (or cannot be reached): the next tier is asked."""
    NOW = "now"
    """By the step being built, before anything reads the entry: resident at once."""
    LATER = "later"
    """Asynchronously: FETCHING until the fill ends (`ChunkCacheManager.fetched`)."""


@dataclass
class Moves:
    """Row copies between the device pool and host memory, for the next step's workers: every
    `host_writes` copy runs before every `host_reads` copy."""

    write_from: list[int] = field(default_factory=list)
    """Device-pool rows copied into host memory ..."""
    write_to: list[int] = field(default_factory=list)
    """... at these host rows (entries evicted from the pool)."""
    read_from: list[int] = field(default_factory=list)
    """Host rows copied into the device pool ..."""
    read_to: list[int] = field(default_factory=list)
    """... at these pool rows (entries found in the host tier)."""


class Tier(Protocol):
    def hold(self, key: bytes) -> None:
        """`key` is about to be offered: keep its copy while the pool makes room (an eviction
        into this tier must not replace it)."""

    def prepare_load(self, entry: Entry) -> Fill:
        """Plan filling `entry` (new, its pages taken) with this tier's copy of its key."""

    def loaded(self, entry: Entry, tokens: int, ok: bool) -> None:
        """A fill of `entry` by this tier ended (`NOW`: at once, ok), to be counted as a hit of
        `tokens` chunk tokens (0: not counted)."""

    def prepare_store(self, entry: Entry) -> None:
        """`entry` leaves the pool (evicted, its rows still hold its K/V this step): keep a copy
        if this tier keeps evicted entries."""

    def take_moves(self, moves: Moves) -> None:
        """The step being built is sent: add its row copies to `moves`; from now on the copies it
        reads or writes may be replaced."""

    def clear(self) -> None:
        """Drop every copy (a cache reset)."""

    def gauges(self) -> dict[str, float]:
        """This tier's gauges for `metrics.stats_payload`."""
