"""What the scheduler tells the workers each step (the KV-connector metadata).

Decisions travel as data: the worker executes these operations and never reads scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


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
    position_shifts: dict[str, int] = field(default_factory=dict)
    """Chunk-path requests scheduled this step: request id → amount subtracted from the RoPE
    position of every token they compute (overlap layout: `sum(len(C_i)) - max(len(C_i))`)."""
