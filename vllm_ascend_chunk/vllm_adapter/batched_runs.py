"""`qattn`'s batched runs as rows of a vLLM step: each run is a request of one step that the
scheduler does not know (the model runner computes its tokens; nothing is sampled) and that is
finished for the runner at the next step. Part of the scheduler's vLLM adapter
(`vllm_adapter.scheduler`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm.v1.core.sched.output import NewRequestData

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from vllm_ascend_chunk.scheduler.recompute_plan import RecomputePlanner


class BatchedRuns:
    """The batched runs of the step being built, added to its output and then retired."""

    def __init__(self, enabled: bool, make_request: Callable[[str, list[int], Request], Request]) -> None:
        self.enabled = enabled
        """Rows that are not requests go only where nothing else reads the step's requests (another
        connector would see them) or keeps steps in flight (pipeline parallelism)."""
        self._make_request = make_request
        self._ids: set[str] = set()

    def add(self, out: SchedulerOutput, recovery: RecomputePlanner, scheduler) -> None:
        """Each run `recovery.batched_runs` hands out, as a new request of this step: the parent's
        tokens and blocks, the run's tokens scheduled (a partial prefill)."""
        if not (self.enabled and recovery.active):
            return
        budget = scheduler.max_num_scheduled_tokens - out.total_num_scheduled_tokens
        rows = scheduler.max_num_running_reqs - len(out.num_scheduled_tokens)
        for run in recovery.batched_runs(out.num_scheduled_tokens, budget, rows):
            request = self._make_request(run.request_id, run.parent.prompt_token_ids, run.parent)
            request.num_computed_tokens = run.start
            block_ids = scheduler.kv_cache_manager.get_block_ids(run.parent.request_id)
            token_ids = request._all_token_ids if scheduler.use_v2_model_runner else None
            out.scheduled_new_reqs.append(NewRequestData.from_request(request, block_ids, token_ids))
            out.num_scheduled_tokens[run.request_id] = run.end - run.start
            out.total_num_scheduled_tokens += run.end - run.start
            self._ids.add(run.request_id)
        if self._ids:  # a run's context ends before its request's: no shared prefix
            out.num_common_prefix_blocks = [0] * len(out.num_common_prefix_blocks)

    def take(self, scheduled: dict[str, int]) -> dict[str, int]:
        """This step's rows, taken out of `scheduled` (vLLM's post-schedule update is for its own
        requests); the caller puts them back and finishes them for the runner's next step."""
        ids, self._ids = self._ids, set()
        return {rid: scheduled.pop(rid) for rid in ids}
