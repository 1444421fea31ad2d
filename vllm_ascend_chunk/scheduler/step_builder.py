"""The step being built: what the scheduler's hooks decided during one `schedule()` (loads of
admitted requests), completed into the step's
`ChunkCacheStepMetadata` with the saves, tier jobs (host copies, remote reads) and scores of that
step. The only writer of step metadata."""

from __future__ import annotations

from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata, ScoreSpec
from vllm_ascend_chunk.scheduler.prefills import Saves
from vllm_ascend_chunk.scheduler.requests import UserRequest
from vllm_ascend_chunk.tiers.base import TierJobs


class StepBuilder:
    def __init__(self) -> None:
        self.meta = ChunkCacheStepMetadata()
        self.loaded: list[UserRequest] = []
        """Requests admitted with a load in this step (LOADING until it is sent)."""

    def load(self, user: UserRequest, rows: list[int], slots: list[int], deltas: list[int] | None) -> None:
        """`user`'s chunk region: pool `rows` into its paged-cache `slots` (re-rotated by `deltas`)."""
        self.loaded.append(user)
        self.meta.load_rows += rows
        self.meta.load_slots += slots
        if deltas is not None:
            self.meta.load_deltas += deltas

    def build(
        self,
        saves: Saves,
        jobs: TierJobs,
        shifts: dict[str, int],
        scores: dict[str, ScoreSpec],
        idle: bool = False,
    ) -> ChunkCacheStepMetadata:
        """The step's metadata: this builder's operations, the step's `saves`, the tiers' `jobs`,
        the position `shifts` of its scheduled chunk-path requests and shadow runs, the `scores`
        to take, and whether the step computes nothing (`idle`)."""
        meta = self.meta
        meta.save_rows, meta.save_slots, meta.remote_writes = saves.rows, saves.slots, saves.writes
        meta.host_write_from, meta.host_write_to = jobs.write_from, jobs.write_to
        meta.host_read_from, meta.host_read_to = jobs.read_from, jobs.read_to
        meta.remote_reads = jobs.remote_reads
        meta.position_shifts = shifts
        meta.scores = scores
        meta.idle = idle
        return meta
