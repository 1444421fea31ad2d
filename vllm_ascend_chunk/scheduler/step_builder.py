"""The step being built: what the scheduler's hooks decided during one `schedule()` (loads of
admitted requests), completed into the step's
`ChunkCacheStepMetadata` with the saves, tiers' jobs and scores of that step. The only writer of
step metadata."""

from __future__ import annotations

from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata, ScoreSpec
from vllm_ascend_chunk.scheduler.prefills import Saves
from vllm_ascend_chunk.scheduler.requests import UserRequest


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
        jobs: dict[str, object],
        shifts: dict[str, int],
        scores: dict[str, ScoreSpec],
        idle: bool = False,
    ) -> ChunkCacheStepMetadata:
        """The step's metadata: this builder's operations, the step's `saves`, the tiers' `jobs`
        (by tier name), the position `shifts` of its scheduled chunk-path requests and
        batched runs, the `scores` to take, and whether the step computes nothing (`idle`)."""
        meta = self.meta
        meta.save_rows, meta.save_slots = saves.rows, saves.slots
        meta.tier_jobs = jobs
        meta.position_shifts = shifts
        meta.scores = scores
        meta.idle = idle
        return meta
