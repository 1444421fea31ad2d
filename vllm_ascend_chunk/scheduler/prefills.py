"""Chunk prefills: the hidden requests that compute missing documents (`SYS + C_i`) into pending
pool entries. Created when a request is planned; each step, the tokens they computed become saves
(paged-cache slot → pool row), and the entries they complete are offered to the tiers; their
outputs never reach a client."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_ascend_chunk.core.paging import slot_of
from vllm_ascend_chunk.scheduler.manager import Entry
from vllm_ascend_chunk.scheduler.requests import UserRequest

if TYPE_CHECKING:
    from vllm.v1.request import Request

CHUNK_PREFILL_ID_PREFIX = "chunk-cache-prefill-"


def is_chunk_prefill(request_id: str) -> bool:
    """Whether `request_id` names a chunk prefill (every process can tell by the id alone)."""
    return request_id.startswith(CHUNK_PREFILL_ID_PREFIX)


@dataclass
class ChunkPrefill:
    """A chunk prefill: a hidden request computing `SYS + C_i` whose K/V fill pending pool entries."""

    request_id: str
    token_ids: list[int]
    pool_rows: list[int]
    """Pool row for each prompt token (-1: not stored)."""
    entries: list[Entry]
    parent: Request
    """The user `Request` that caused the prefill (LoRA, salt, priority are taken from it)."""
    block_ids: list[int] = field(default_factory=list)
    """Its paged-cache blocks, as the scheduler outputs announce them."""


@dataclass
class Saves:
    """What a step's chunk-prefill tokens become: pool rows filled from paged-cache slots; and
    the entries whose last tokens these are."""

    rows: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    completed: list[Entry] = field(default_factory=list)
    """Entries whose K/V the pool holds whole after the step's saves (`Kept.COMPUTED`)."""


class ChunkPrefills:
    """The chunk prefills in flight (`by_id`) and those that just ended."""

    def __init__(self, page_size: int, block_size: int) -> None:
        self.page_size = page_size
        self.block_size = block_size
        self.by_id: dict[str, ChunkPrefill] = {}
        self._ended: set[str] = set()
        self._counter = itertools.count()
        self._id_prefix = f"{CHUNK_PREFILL_ID_PREFIX}{uuid.uuid4().hex[:8]}-"

    def create(self, user: UserRequest, created: Sequence[Entry]) -> list[ChunkPrefill]:
        """The prefills that compute `created`, entries `user` holds: one per chunk, `SYS + C_i`
        (SYS stored by the first of them if it is created too), or SYS alone."""
        info, ids = user.info, user.request.prompt_token_ids
        sys_entry = user.entries[0] if info.sys_len else None
        store_sys = sys_entry is not None and sys_entry in created
        prefills: list[ChunkPrefill] = []
        for i, entry in enumerate(user.entries[1 if info.sys_len else 0 :]):
            if entry not in created or any(entry in p.entries for p in prefills):
                continue
            start, end = info.chunk_span(i)
            rows = (self.rows(sys_entry) if store_sys else [-1] * info.sys_len) + self.rows(entry)
            entries = [sys_entry, entry] if store_sys else [entry]
            prefills.append(self._new(ids[: info.sys_len] + ids[start:end], rows, entries, user))
            store_sys = False
        if store_sys:  # every chunk was resident, only SYS is missing
            prefills.append(self._new(ids[: info.sys_len], self.rows(sys_entry), [sys_entry], user))
        return prefills

    def _new(
        self, token_ids: list[int], rows: list[int], entries: list[Entry], user: UserRequest
    ) -> ChunkPrefill:
        prefill = ChunkPrefill(
            request_id=f"{self._id_prefix}{next(self._counter)}",
            token_ids=list(token_ids),
            pool_rows=rows,
            entries=entries,
            parent=user.request,
        )
        self.by_id[prefill.request_id] = prefill
        return prefill

    def rows(self, entry: Entry) -> list[int]:
        """The pool row of each of `entry`'s tokens."""
        return entry.rows(self.page_size)

    def track_blocks(self, scheduler_output) -> dict[str, int]:
        """Records the blocks the step's scheduler output gives the prefills; the prefills it
        schedules → the first token each computes in it."""
        pieces = {}
        for new in scheduler_output.scheduled_new_reqs:
            if (prefill := self.by_id.get(new.req_id)) is not None:
                prefill.block_ids = list(new.block_ids[0])
                pieces[prefill.request_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new_blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            if (prefill := self.by_id.get(rid)) is None:
                continue
            if rid in cached.resumed_req_ids:  # preempted, then given blocks anew
                prefill.block_ids = []
            prefill.block_ids += new_blocks[0] if new_blocks else []
            pieces[rid] = computed
        return pieces

    def saves(self, pieces: dict[str, int], num_scheduled_tokens: dict[str, int]) -> Saves:
        """The saves of the `pieces` (`track_blocks`), and the entries they complete."""
        saves = Saves()
        for rid, start in pieces.items():
            prefill = self.by_id[rid]
            end = start + num_scheduled_tokens[rid]
            for t in range(start, end):
                if prefill.pool_rows[t] >= 0:
                    saves.rows.append(prefill.pool_rows[t])
                    saves.slots.append(slot_of(prefill.block_ids, self.block_size, t))
            if end == len(prefill.token_ids):
                saves.completed += prefill.entries
        return saves

    def finish(self, request_id: str) -> ChunkPrefill | None:
        """The prefill `request_id` ended (None: not a prefill); its outputs stay hidden once more."""
        prefill = self.by_id.pop(request_id, None)
        if prefill is not None:
            self._ended.add(request_id)
        return prefill

    def take_ids_to_hide(self) -> set[str]:
        """Ids of chunk prefills whose outputs must not reach clients: running, or just ended."""
        hidden = self._ended | self.by_id.keys()
        self._ended = set()
        return hidden
