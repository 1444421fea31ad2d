"""What the scheduler tells the workers each step (the KV-connector metadata), and what the
workers tell the scheduler back (the KV-connector worker metadata).

Decisions travel as data: the worker executes these operations and never reads scheduler state.
Order on the worker: copies into the host tier, copies out of it, remote reads started, loads;
the forward; saves, remote writes; remote reads finished and reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


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
class ChunkCacheStepMetadata(KVConnectorMetadata):
    load_rows: list[int] = field(default_factory=list)
    """Pool rows to copy into the paged KV cache before the forward ..."""
    load_slots: list[int] = field(default_factory=list)
    """... and the paged-cache slot each row goes to."""
    load_deltas: list[int] = field(default_factory=list)
    """Sequential layout: RoPE position delta of each loaded row (its keys are re-rotated by it
    on the way); empty in the overlap layout."""
    save_rows: list[int] = field(default_factory=list)
    """Pool rows to fill after the forward with the post-RoPE K/V of chunk-prefill tokens
    computed in this step ..."""
    save_slots: list[int] = field(default_factory=list)
    """... read from the paged-cache slot the forward wrote each token into."""
    host_write_from: list[int] = field(default_factory=list)
    """Pool rows copied into the host tier at the start of the step (entries evicted) ..."""
    host_write_to: list[int] = field(default_factory=list)
    """... at these host rows."""
    host_read_from: list[int] = field(default_factory=list)
    """Host rows copied into the pool next (entries found in the host tier) ..."""
    host_read_to: list[int] = field(default_factory=list)
    """... at these pool rows."""
    remote_reads: list[RemoteRead] = field(default_factory=list)
    """Entries to read from the remote store; each is reported in `ChunkCacheWorkerMetadata`."""
    remote_writes: list[RemoteWrite] = field(default_factory=list)
    """Entries completed by this step's saves, written to the remote store after them."""
    position_shifts: dict[str, int] = field(default_factory=dict)
    """Chunk-path requests scheduled this step: request id → amount subtracted from the RoPE
    position of every token they compute (overlap layout: `sum(len(C_i)) - max(len(C_i))`)."""


@dataclass
class ChunkCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """A step's report from the workers; reports of several workers are merged (`aggregate`)."""

    reads: dict[int, bool] = field(default_factory=dict)
    """`RemoteRead.read_id` → whether the entry is now in the pool rows (on every worker)."""
    remote_up: dict[int, bool] = field(default_factory=dict)
    """Worker rank (`ShardIdentity.rank`) → whether its remote store is reachable (no entry: the
    rank has no remote tier, or nothing new to report; the scheduler keeps each rank's last one)."""
    remote_counters: dict[int, dict[str, int]] = field(default_factory=dict)
    """Worker rank → its remote store's running counters (`RemoteStore.stats`)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> ChunkCacheWorkerMetadata:
        assert isinstance(other, ChunkCacheWorkerMetadata)
        reads = {i: ok and other.reads.get(i, False) for i, ok in self.reads.items()}
        reads.update({i: False for i in other.reads.keys() - reads.keys()})
        return ChunkCacheWorkerMetadata(
            reads=reads,
            remote_up={**self.remote_up, **other.remote_up},
            remote_counters={**self.remote_counters, **other.remote_counters},
        )
