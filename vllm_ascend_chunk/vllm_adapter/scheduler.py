"""vLLM schedulers with the chunk cache: chunk prefills in, their outputs hidden; `qattn` runs
as batch rows of one step.

The scheduler side's vLLM adapter, beside the connector (the logic is in `scheduler/`).
Selected automatically (`config.engine.configure`) as `ChunkCacheScheduler` or, with async
scheduling, `ChunkCacheAsyncScheduler`. Everything else is vLLM's own scheduling. They reach the
chunk cache only through vLLM's KV connector: `ChunkCacheConnector` (its scheduler role), itself
or a child of `ChunkCacheMultiConnector` next to other connectors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from vllm_ascend_chunk.scheduler.prefills import ChunkPrefill
from vllm_ascend_chunk.vllm_adapter.batched_runs import BatchedRuns
from vllm_ascend_chunk.vllm_adapter.connector import chunk_connector_of
from vllm_ascend_chunk.vllm_adapter.stats_relay import StatsRelay

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from vllm_ascend_chunk.vllm_adapter.connector import ChunkCacheConnector


class _ChunkCacheSchedulerMixin:
    connector: KVConnectorBase_V1
    """Set by vLLM's scheduler; `config.engine.configure` makes it the chunk cache or a
    `ChunkCacheMultiConnector` holding it."""
    chunk_connector: ChunkCacheConnector
    """The chunk cache's connector (scheduler role), found in `connector`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        chunk_connector = chunk_connector_of(self.connector)
        assert chunk_connector is not None, "config.engine.configure sets the chunk cache's connector"
        self.chunk_connector = chunk_connector
        self.recovery = chunk_connector.coordinator.recompute
        """The recovery path (`qattn`, `cover`), asked directly: idle unless a request selects."""
        hash_block_size = kwargs.get("hash_block_size") or self.block_size
        self._prefill_block_hasher = get_request_block_hasher(
            hash_block_size, get_hash_fn_by_name(self.cache_config.prefix_caching_hash_algo)
        )
        self._stats = StatsRelay(self.connector, chunk_connector)
        self._batched_runs = BatchedRuns(
            self._stats.alone and not self.use_pp and not self.enable_return_routed_experts, self._own_request
        )

    def schedule(self):
        for prefill in self.chunk_connector.plan():
            self.add_request(self._prefill_request(prefill))
        self.recovery.reposition(self.running)
        return super().schedule()

    def _build_kv_connector_meta(self, connector, scheduler_output):
        """vLLM's, once the `qattn` runs this step also computes are in the output."""
        self._batched_runs.add(scheduler_output, self.recovery, self)
        return super()._build_kv_connector_meta(connector, scheduler_output)

    def _update_after_schedule(self, scheduler_output) -> None:
        """vLLM's for its requests; this step's batched runs are finished for the runner next step."""
        scheduled = scheduler_output.num_scheduled_tokens
        batched = self._batched_runs.take(scheduled)
        super()._update_after_schedule(scheduler_output)
        scheduled.update(batched)
        self.finished_req_ids |= batched.keys()

    def chunk_token_cap(self, request: Request, num_new_tokens: int, num_computed_tokens: int) -> int:
        """Tokens `request` may compute this step (`hooks.cap_new_tokens`)."""
        return self.recovery.token_cap(request, num_new_tokens, num_computed_tokens)

    def _prefill_request(self, prefill: ChunkPrefill) -> Request:
        """A prefill-only request computing `SYS + C_i` exactly (never reads the prefix cache)."""
        parent = prefill.parent
        return self._own_request(
            prefill.request_id,
            prefill.token_ids,
            parent,
            cache_salt=parent.cache_salt,
            priority=parent.priority,
            block_hasher=self._prefill_block_hasher,
        )

    @staticmethod
    def _own_request(request_id: str, token_ids: list[int], parent: Request, **kwargs) -> Request:
        """A request of the chunk cache's own, for `parent`: greedy, one token no client sees, the
        parent's adapter, no prefix cache read."""
        params = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, skip_reading_prefix_cache=True
        )
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            pooling_params=None,
            arrival_time=parent.arrival_time,
            lora_request=parent.lora_request,
            **kwargs,
        )

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._drop_finished_skipped()
        if hidden := self.chunk_connector.take_prefill_ids_to_hide():
            for eco in outputs.values():
                eco.outputs = [o for o in eco.outputs if o.request_id not in hidden]
                if eco.finished_requests:
                    eco.finished_requests -= hidden
        self._stats.deliver(outputs)
        return outputs

    def _drop_finished_skipped(self) -> None:
        """Take requests that finished while waiting out of `skipped_waiting`.

        With batches in flight (pipeline parallelism), a request preempted (KV pressure, a cache
        reset) while its last token is computed waits; a chunk-path request waits in
        `skipped_waiting` when its documents must be computed again (the connector answers None).
        The token then finishes it, and vLLM takes a finished preempted request out of `waiting`
        only: left in `skipped_waiting`, the next `schedule()` would raise on its status.
        """
        if finished := [r for r in self.skipped_waiting if r.is_finished()]:
            self.skipped_waiting.remove_requests(finished)

    def _preempt_request(self, request: Request, timestamp: float) -> None:
        super()._preempt_request(request, timestamp)
        self.chunk_connector.on_preempted(request)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's reset; the chunk pool is always dropped with it (stale document KV, e.g. after
        a weight update, must never be loaded), not only when `reset_connector` is asked (other
        connectors' stores are reset only then, as vLLM does)."""
        reset = super().reset_prefix_cache(reset_running_requests, reset_connector)
        if not reset_connector:
            self.chunk_connector.reset_cache()
        return reset

    def make_stats(self, *args, **kwargs):
        """vLLM's stats plus the chunk cache payload (`StatsRelay.attach`)."""
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:
            self._stats.attach(stats)
        return stats


class ChunkCacheScheduler(_ChunkCacheSchedulerMixin, Scheduler):
    pass


class ChunkCacheAsyncScheduler(_ChunkCacheSchedulerMixin, AsyncScheduler):
    pass
