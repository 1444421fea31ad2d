"""What the scheduler tells the workers each step (the KV-connector metadata), and what the
workers tell the scheduler back (the KV-connector worker metadata).

Decisions travel as data: the worker executes these operations and never reads scheduler state.
Order on the worker: copies into the host tier, copies out of it, remote reads started, loads;
the forward; saves, remote writes; the remote reads that ended by then reported
(`tiers.worker_base`; a read may take several steps).
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
class ScoreSpec:
    """Score a `qattn` request's question piece computed this step (`scheduler/selection.py`)."""

    first: int
    """Token index of the piece's first token (its rows follow the request's in the batch)."""
    key_slots: list[int]
    """Paged-cache slot of every token of the request before the piece's end."""
    region: tuple[int, int]
    """Token indices `[start, end)` of the document region, whose attention weights are summed."""


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
    scores: dict[str, ScoreSpec] = field(default_factory=dict)
    """`qattn` requests whose question piece this step computes: request id → what to score."""
    idle: bool = False
    """No request computes tokens this step (every one waits, e.g. on remote reads): a worker
    may wait a little for its reads at the step's end rather than end it at once."""


@dataclass
class ChunkCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """A step's report from the workers; reports of several workers are merged (`aggregate`)."""

    reads: dict[int, dict[int, bool]] = field(default_factory=dict)
    """Worker rank (`ShardIdentity.rank`) → the reads it ended since its last report:
    `RemoteRead.read_id` → whether its shard of the entry is now in the pool rows. Ranks end a
    read in different steps; the scheduler counts it read once every rank has (`RemoteReads`)."""
    remote_up: dict[int, bool] = field(default_factory=dict)
    """Worker rank (`ShardIdentity.rank`) → whether its remote store is reachable (no entry: the
    rank has no remote tier, or nothing new to report; the scheduler keeps each rank's last one)."""
    remote_counters: dict[int, dict[str, int]] = field(default_factory=dict)
    """Worker rank → its remote store's running counters (`RemoteStore.stats`)."""
    scores: dict[str, list[float] | None] = field(default_factory=dict)
    """`ScoreSpec` request id → per region token, the attention weight the piece's queries gave it,
    summed over this worker's heads (None: not scored); workers' sums add up."""

    @staticmethod
    def union(parts: list[ChunkCacheWorkerMetadata]) -> ChunkCacheWorkerMetadata:
        """One worker's report from its parts (its tiers', its scores), which never name the same
        read, rank or request."""
        return ChunkCacheWorkerMetadata(
            reads={k: v for p in parts for k, v in p.reads.items()},
            remote_up={k: v for p in parts for k, v in p.remote_up.items()},
            remote_counters={k: v for p in parts for k, v in p.remote_counters.items()},
            scores={k: v for p in parts for k, v in p.scores.items()},
        )

    def aggregate(self, other: KVConnectorWorkerMetadata) -> ChunkCacheWorkerMetadata:
        assert isinstance(other, ChunkCacheWorkerMetadata)
        scores = dict(self.scores)
        for rid, theirs in other.scores.items():
            ours = scores.get(rid, [])
            if ours is None or theirs is None:
                scores[rid] = None
            else:
                scores[rid] = [a + b for a, b in zip(ours, theirs, strict=True)] if ours else theirs
        return ChunkCacheWorkerMetadata(
            reads={**self.reads, **other.reads},
            remote_up={**self.remote_up, **other.remote_up},
            remote_counters={**self.remote_counters, **other.remote_counters},
            scores=scores,
        )
