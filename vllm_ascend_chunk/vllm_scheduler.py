"""vLLM schedulers with the chunk cache: chunk prefills in, their outputs hidden; `qattn` runs
as batch rows of one step.

The scheduler side's vLLM adapter, beside the connector (the logic is in `scheduler/`).
Selected automatically (`engine_config.configure`) as `ChunkCacheScheduler` or, with async
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
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from vllm_ascend_chunk.connector import chunk_connector_of
from vllm_ascend_chunk.scheduler.prefills import ChunkPrefill

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from vllm_ascend_chunk.connector import ChunkCacheConnector


class _ChunkCacheSchedulerMixin:
    connector: KVConnectorBase_V1
    """Set by vLLM's scheduler; `engine_config.configure` makes it the chunk cache or a
    `ChunkCacheMultiConnector` holding it."""
    chunk_connector: ChunkCacheConnector
    """The chunk cache's connector (scheduler role), found in `connector`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        chunk_connector = chunk_connector_of(self.connector)
        assert chunk_connector is not None, "engine_config.configure sets the chunk cache's connector"
        self.chunk_connector = chunk_connector
        hash_block_size = kwargs.get("hash_block_size") or self.block_size
        self._prefill_block_hasher = get_request_block_hasher(
            hash_block_size, get_hash_fn_by_name(self.cache_config.prefix_caching_hash_algo)
        )
        # Rows that are not requests: only where nothing else reads the step's requests (another
        # connector would see them) or keeps steps in flight (pipeline parallelism).
        only_chunk_cache = self.connector is self.chunk_connector
        self._shadows_allowed = only_chunk_cache and not self.use_pp and not self.enable_return_routed_experts
        self._shadow_ids: set[str] = set()

    def schedule(self):
        for prefill in self.chunk_connector.plan():
            self.add_request(self._prefill_request(prefill))
        self.chunk_connector.reposition(self.running)
        return super().schedule()

    def _build_kv_connector_meta(self, connector, scheduler_output):
        """vLLM's, once the `qattn` runs this step also computes are in the output."""
        if self._shadows_allowed:
            self._add_shadow_runs(scheduler_output)
        return super()._build_kv_connector_meta(connector, scheduler_output)

    def _add_shadow_runs(self, out) -> None:
        """Each run `shadow_runs` hands out, as a new request of one step for the model runner: the
        request's tokens and blocks, its run's tokens scheduled (a partial prefill: nothing is
        sampled). The scheduler does not know it; the runner drops it at the next step."""
        budget = self.max_num_scheduled_tokens - out.total_num_scheduled_tokens
        rows = self.max_num_running_reqs - len(out.num_scheduled_tokens)
        for shadow in self.chunk_connector.shadow_runs(out.num_scheduled_tokens, budget, rows):
            request = self._own_request(shadow.request_id, shadow.parent.prompt_token_ids, shadow.parent)
            request.num_computed_tokens = shadow.start
            block_ids = self.kv_cache_manager.get_block_ids(shadow.parent.request_id)
            token_ids = request._all_token_ids if self.use_v2_model_runner else None
            out.scheduled_new_reqs.append(NewRequestData.from_request(request, block_ids, token_ids))
            out.num_scheduled_tokens[shadow.request_id] = shadow.end - shadow.start
            out.total_num_scheduled_tokens += shadow.end - shadow.start
            self._shadow_ids.add(shadow.request_id)
        if self._shadow_ids:  # a shadow's context ends before its request's: no shared prefix
            out.num_common_prefix_blocks = [0] * len(out.num_common_prefix_blocks)

    def _update_after_schedule(self, scheduler_output) -> None:
        """vLLM's for its requests; this step's shadow runs are finished for the runner next step."""
        scheduled = scheduler_output.num_scheduled_tokens
        shadows = {rid: scheduled.pop(rid) for rid in self._shadow_ids}
        super()._update_after_schedule(scheduler_output)
        scheduled.update(shadows)
        self.finished_req_ids |= self._shadow_ids
        self._shadow_ids = set()

    def chunk_token_cap(self, request: Request, num_new_tokens: int, num_computed_tokens: int) -> int:
        """Tokens `request` may compute this step (`scheduler_hooks.cap_new_tokens`)."""
        return self.chunk_connector.token_cap(request, num_new_tokens, num_computed_tokens)

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
        self._deliver_stats(outputs)
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

    def _deliver_stats(self, outputs) -> None:
        """The payload goes with stats a frontend records: those of a step with outputs (vLLM's
        offline engine drops the others); otherwise it is taken out and its increments wait."""
        for eco in outputs.values():
            if eco.scheduler_stats is None or (payload := self._payload(eco.scheduler_stats)) is None:
                continue
            if eco.outputs:
                self.chunk_connector.stats_delivered(payload)
            elif self.connector is self.chunk_connector:
                eco.scheduler_stats.kv_connector_stats = None
            else:
                del eco.scheduler_stats.kv_connector_stats[type(self.chunk_connector).__name__]

    def _payload(self, stats) -> dict | None:
        """The chunk cache payload in `stats` (`make_stats` put it there), or None."""
        data = stats.kv_connector_stats
        if self.connector is self.chunk_connector or not data:
            return data
        return data.get(type(self.chunk_connector).__name__, {}).get("data")

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
        """vLLM's stats plus the chunk cache payload, in the slot vLLM keeps for connector stats;
        next to other connectors, under its class name among theirs, as `MultiConnector` keeps
        them (in the serialized form `{"data": ...}` it rebuilds by connector name)."""
        stats = super().make_stats(*args, **kwargs)
        if stats is None:
            return stats
        payload = self.chunk_connector.stats_payload()
        if self.connector is self.chunk_connector:
            stats.kv_connector_stats = payload
        else:
            name = type(self.chunk_connector).__name__
            stats.kv_connector_stats = {**(stats.kv_connector_stats or {}), name: {"data": payload}}
        return stats


class ChunkCacheScheduler(_ChunkCacheSchedulerMixin, Scheduler):
    pass


class ChunkCacheAsyncScheduler(_ChunkCacheSchedulerMixin, AsyncScheduler):
    pass
