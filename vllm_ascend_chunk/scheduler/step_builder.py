"""The step being built: what the scheduler's hooks decided during one `schedule()` (loads of
admitted requests, remote reads, shadow runs' position shifts), turned into the step's
`ChunkCacheStepMetadata` with the saves, host-tier copies and scores of that step. The only
writer of step metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_ascend_chunk.scheduler.manager import Moves
from vllm_ascend_chunk.scheduler.prefills import Saves
from vllm_ascend_chunk.scheduler.recompute_plan import ShadowRun
from vllm_ascend_chunk.scheduler.requests import UserRequest
from vllm_ascend_chunk.step import ChunkCacheStepMetadata, RemoteRead, ScoreSpec


@dataclass
class StepBuilder:
    loaded: list[UserRequest] = field(default_factory=list)
    """Requests admitted with a load in this step (LOADING until it is sent)."""
    load_rows: list[int] = field(default_factory=list)
    load_slots: list[int] = field(default_factory=list)
    load_deltas: list[int] = field(default_factory=list)
    remote_reads: list[RemoteRead] = field(default_factory=list)
    shadow_shifts: dict[str, int] = field(default_factory=dict)

    def load(self, user: UserRequest, rows: list[int], slots: list[int], deltas: list[int] | None) -> None:
        """`user`'s chunk region: pool `rows` into its paged-cache `slots` (re-rotated by `deltas`)."""
        self.loaded.append(user)
        self.load_rows += rows
        self.load_slots += slots
        if deltas is not None:
            self.load_deltas += deltas

    def read(self, read: RemoteRead) -> None:
        self.remote_reads.append(read)

    def shadow(self, run: ShadowRun) -> None:
        self.shadow_shifts[run.request_id] = run.shift

    def build(
        self, saves: Saves, moves: Moves, shifts: dict[str, int], scores: dict[str, ScoreSpec]
    ) -> ChunkCacheStepMetadata:
        """The step's metadata: this builder's operations, the step's `saves`, host-tier `moves`,
        the position `shifts` of its scheduled chunk-path requests and the `scores` to take."""
        return ChunkCacheStepMetadata(
            load_rows=self.load_rows,
            load_slots=self.load_slots,
            load_deltas=self.load_deltas,
            save_rows=saves.rows,
            save_slots=saves.slots,
            host_write_from=moves.write_from,
            host_write_to=moves.write_to,
            host_read_from=moves.read_from,
            host_read_to=moves.read_to,
            remote_reads=self.remote_reads,
            remote_writes=saves.writes,
            position_shifts={**shifts, **self.shadow_shifts},
            scores=scores,
        )
