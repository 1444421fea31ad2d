"""A chunk-path request's state with its chunks (`ChunkPathStatus`; transitions: `coordinator.py`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_ascend_chunk.core.request_info import ChunkCacheInfo
from vllm_ascend_chunk.scheduler.manager import Entry
from vllm_ascend_chunk.scheduler.selection import Selection

if TYPE_CHECKING:
    from vllm.v1.request import Request


class ChunkPathStatus(enum.Enum):
    """Where a chunk-path request stands with its chunks (transitions: `ChunkCacheCoordinator`)."""

    WAITING = "waiting"
    """Needs a plan; holds no pins (new, preempted after its load, or unplanned)."""
    PLANNED = "planned"
    """Its SYS and chunk entries are pinned; it waits until every one is resident."""
    LOADING = "loading"
    """Admitted this step: its load is in the step being built; pins held until it is sent."""
    LOADED = "loaded"
    """Its chunk region is in its own blocks (loaded, or a prefix-cache hit); no pins."""
    EXTERNAL = "external"
    """Another connector loads its KV, chunk region included (P/D decode instance); no pins."""


@dataclass
class UserRequest:
    """A client's chunk-path request (not a chunk prefill the coordinator made) and its
    chunk-cache state."""

    request: Request
    info: ChunkCacheInfo
    status: ChunkPathStatus = ChunkPathStatus.WAITING
    entries: list[Entry] | None = None
    """Pinned SYS entry (if any) followed by one entry per chunk, while PLANNED or LOADING."""
    counted: bool = False
    """Its chunks have been counted in the hit/miss statistics (once per request)."""
    selection: Selection | None = None
    """Its `qattn` passes (None: it recomputes nothing in place)."""
    block_ids: list[int] = field(default_factory=list)
    """Its paged-cache blocks, tracked while it has a selection (the scores read its keys)."""
    private: bool = False
    """Other KV connectors never see it (`ChunkCacheCoordinator.private`)."""

    def needs(self) -> list[tuple[bytes, int]]:
        """(key, tokens) of its SYS entry, if any, then of each chunk."""
        sys = [(self.info.sys_hash, self.info.sys_len)] if self.info.sys_len else []
        return sys + list(zip(self.info.chunk_hashes, self.info.chunk_lens, strict=True))

    @property
    def ready(self) -> bool:
        """PLANNED and every entry resident: it can be admitted with its chunks loaded."""
        return self.status is ChunkPathStatus.PLANNED and all(e.resident for e in self.entries)
