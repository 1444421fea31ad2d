"""What the scheduler tells the workers each step (the KV-connector metadata), and what the
workers tell the scheduler back (the KV-connector worker metadata).

Decisions travel as data: the worker executes these operations and never reads scheduler state.
Order on the worker: each tier's jobs started (in the tiers' order), loads; the forward; saves,
then each tier's saves; each tier's report of what ended by then (`tiers.worker_base`; a tier's
fill may take several steps). The tiers' jobs and reports are theirs to define: here they are
values under the tier's name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class ScoreSpec:
    """Score a `qattn` request's question piece computed this step (`scheduler/selection.py`)."""

    piece_start: int
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
    tier_jobs: dict[str, Any] = field(default_factory=dict)
    """Tier name (`tiers.base.Tier.name`) → what its workers do this step (`Tier.take_jobs`)."""
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

    tiers: dict[str, dict[int, Any]] = field(default_factory=dict)
    """Tier name → worker rank → that rank's report of the tier (`WorkerTier.finish`; only
    ranks with news). Ranks may end one fill in different steps: the tier votes
    (`Tier.reported`)."""
    scores: dict[str, list[float] | None] = field(default_factory=dict)
    """`ScoreSpec` request id → per region token, the attention weight the piece's queries gave it,
    summed over this worker's heads (None: not scored); workers' sums add up."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> ChunkCacheWorkerMetadata:
        assert isinstance(other, ChunkCacheWorkerMetadata)
        scores = dict(self.scores)
        for rid, theirs in other.scores.items():
            ours = scores.get(rid, [])
            if ours is None or theirs is None:
                scores[rid] = None
            else:
                scores[rid] = [a + b for a, b in zip(ours, theirs, strict=True)] if ours else theirs
        return ChunkCacheWorkerMetadata(tiers=_merge_tiers([self.tiers, other.tiers]), scores=scores)


def _merge_tiers(parts: Iterable[dict[str, dict[int, Any]]]) -> dict[str, dict[int, Any]]:
    """The tiers' reports of several workers (each rank reports for itself)."""
    merged: dict[str, dict[int, Any]] = {}
    for part in parts:
        for name, by_rank in part.items():
            merged.setdefault(name, {}).update(by_rank)
    return merged
