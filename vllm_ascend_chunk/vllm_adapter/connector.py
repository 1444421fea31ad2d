"""ChunkCacheConnector: the chunk cache as a vLLM KV connector (scheduler and worker roles).

vLLM builds one instance per role. The scheduler role defers chunk-path requests until their
chunks are in the pool, then reports their chunk region as externally computed and emits the
loads; the worker role owns the pool and executes each step's operations. The connector is
configured automatically (`config.engine.configure`): alone, or, when the user configures other
KV connectors, as the first child of `ChunkCacheMultiConnector` (vLLM's `MultiConnector` with one
routing rule, below). `chunk_connector_of` finds it in either.

The scheduler role is the one way into the chunk cache's scheduler side: vLLM's scheduler calls
its KV-connector methods, and `ChunkCacheScheduler` calls the few more it needs (planning chunk
prefills, hiding their outputs, preemption, stats), all delegated to `ChunkCacheCoordinator`.

It declares `SupportsHMA` so that vLLM keeps its hybrid KV cache manager on: the chunk cache is
only configured for models whose layers form a single full-attention KV cache group
(`config.engine`), where the hybrid manager behaves as the single-group one.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorMetadata,
)

from vllm_ascend_chunk.config.engine_settings import engine_settings, pool_geometry
from vllm_ascend_chunk.config.pool_size import stage_geometry
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata, ChunkCacheWorkerMetadata
from vllm_ascend_chunk.metrics import (
    INCREMENTS,
    ChunkCacheConnectorStats,
    ChunkCachePromMetrics,
    forget_delivered,
    stats_payload,
)
from vllm_ascend_chunk.scheduler.coordinator import ChunkCacheCoordinator
from vllm_ascend_chunk.scheduler.prefills import ChunkPrefill, is_chunk_prefill
from vllm_ascend_chunk.worker.chunk_worker import ChunkCacheWorker

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.chunk_cache")


class ChunkCacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.coordinator: ChunkCacheCoordinator | None = None
        self.chunk_worker: ChunkCacheWorker | None = None
        self._delivered: dict[str, int] = {}
        """Counter totals of the last payload that reached a frontend (`stats_delivered`)."""
        if role == KVConnectorRole.SCHEDULER:
            block_size = _single_group(kv_cache_config).kv_cache_spec.block_size
            priority = vllm_config.scheduler_config.policy == "priority"
            self.coordinator = ChunkCacheCoordinator(
                pool_geometry(vllm_config),
                block_size,
                engine_settings(vllm_config),
                priority_order=priority,
                ranks=vllm_config.parallel_config.tensor_parallel_size
                * vllm_config.parallel_config.pipeline_parallel_size,
            )
        else:
            from vllm.distributed.parallel_state import get_pp_group, model_parallel_is_initialized

            # (a connector built outside a worker, e.g. in a unit test, has no process groups)
            stage = get_pp_group().rank_in_group if model_parallel_is_initialized() else 0
            self.chunk_worker = ChunkCacheWorker(vllm_config, stage_geometry(vllm_config, stage))

    # -- scheduler role ------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self.coordinator.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.coordinator.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        self.coordinator.update_state_after_alloc(request, blocks, num_external_tokens)

    def owns(self, request: Request) -> bool:
        """Whether `request` is a chunk-path request or a chunk prefill (its KV is the chunk cache's)."""
        return self.coordinator.owns(request)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.coordinator.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.coordinator.request_finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` for the hybrid manager: one group, blocks freed by vLLM at once."""
        return self.request_finished(request, block_ids[0])

    def reset_cache(self) -> bool | None:
        return self.coordinator.reset()

    def update_connector_output(self, connector_output) -> None:
        """The workers' report of a step (remote reads ended, the store's state)."""
        self.coordinator.update_connector_output(connector_output.kv_connector_worker_meta)

    # -- scheduler role, called by `ChunkCacheScheduler` only (not part of vLLM's connector API) --
    def plan(self) -> list[ChunkPrefill]:
        """Chunk prefills to add as requests before a step is scheduled (`ChunkCacheCoordinator.plan`)."""
        return self.coordinator.plan()

    def take_prefill_ids_to_hide(self) -> set[str]:
        """Request ids whose outputs must not reach clients: chunk prefills running or just ended."""
        return self.coordinator.take_prefill_ids_to_hide()

    def on_preempted(self, request: Request) -> None:
        """vLLM's scheduler preempted `request` (it lost its blocks, and with them any loaded chunks)."""
        self.coordinator.on_preempted(request)

    def stats_payload(self) -> dict[str, Any]:
        """The statistics payload for this step's `SchedulerStats` (`vllm_ascend_chunk.metrics`):
        totals, gauges and the counters' increments since the last delivered payload."""
        return stats_payload(self.coordinator.manager, self._delivered)

    def stats_delivered(self, payload: dict[str, Any]) -> None:
        """`payload` goes to a frontend: later increments count from its totals."""
        self._delivered = {name: payload[name] for name in payload[INCREMENTS]}
        forget_delivered(self.coordinator.manager, payload)

    # -- statistics (payload made by the scheduler, see `vllm_ascend_chunk.metrics`) -------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ChunkCacheConnectorStats:
        return ChunkCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> ChunkCachePromMetrics:
        return ChunkCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker role ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self.chunk_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ChunkCacheStepMetadata)
        self.chunk_worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # a graph replay would skip it: the pool is filled in `wait_for_save` instead

    def wait_for_save(self) -> None:
        """After the forward: chunk-prefill tokens, from the slots it wrote, into the pool."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, ChunkCacheStepMetadata)
        self.chunk_worker.save(meta)

    def build_connector_worker_meta(self) -> ChunkCacheWorkerMetadata | None:
        """The step's end (with or without a forward): the remote reads that ended, reported."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, ChunkCacheStepMetadata)
        return self.chunk_worker.report(meta)

    def shutdown(self) -> None:
        if self.chunk_worker is not None:
            self.chunk_worker.shutdown()


class ChunkCacheMultiConnector(MultiConnector):
    """vLLM's `MultiConnector` with the chunk cache as its first child (`config.engine.configure`).

    MultiConnector loads a request from the first child reporting matched tokens and lets every
    child save it. Here a request the chunk cache owns is answered by the chunk cache alone: a
    chunk prefill must compute its tokens (the pool is filled from what its forward wrote, so a
    prefix-keyed store that held `SYS + C_i` would leave its entries unwritten), and a chunk-path
    request's documents come from the pool. The other children never see a private request
    (`ChunkCacheCoordinator.private`: chunk prefills, and chunk-path requests with a recovery mode
    or a `cache_salt`): not when it arrives, is allocated, is scheduled (they build their
    metadata from the step without it) or ends. They see the other chunk-path requests
    (`update_state_after_alloc` with no blocks) and may store their blocks, which live in the
    chunk namespace (`scheduler/block_keys.py`) that no ordinary request hits. Ordinary requests
    go through MultiConnector unchanged; the chunk cache answers 0 for them.

    Prefill/decode disaggregation: on the prefill instance (a `kv_producer` child) the producer
    sends a plain chunk-path request's blocks, which hold its whole KV once its chunks are loaded.
    On the decode instance such a request is offered to the loading children (`kv_consumer` or
    `kv_both`) when it arrives: one that would load its whole chunk region loads it
    (`load_elsewhere`: no plan, no chunk prefill; the chunk cache still places the tokens the
    decode instance computes); otherwise, or if that child no longer covers the region when the
    request is scheduled, the chunk cache serves it as a single instance would. A private
    request is always served by the instance it reaches: a connector keying KV by token ids
    (`ExampleConnector`) would hand it another mode's or tenant's KV, or a `qattn` request's from
    before its runs were recomputed.
    """

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        chunk_connector = self._connectors[0]
        assert isinstance(chunk_connector, ChunkCacheConnector), "the chunk cache is the first child"
        self.chunk_connector: ChunkCacheConnector = chunk_connector
        self._consumers = [i for i, kv in enumerate(self._ktc_kv_transfer_config) if i and kv.is_kv_consumer]
        """Children that may load what a P/D prefill instance computed (`kv_consumer`, or `kv_both`
        as NIXL is often configured on both sides)."""
        self._private_ended: set[str] = set()
        """Private requests that ended since the last step was built (`_without_private`)."""

    def on_new_request(self, request: Request) -> None:
        self.chunk_connector.on_new_request(request)
        coordinator = self.chunk_connector.coordinator
        if coordinator.private(request.request_id):
            return
        for other in self._connectors[1:]:
            other.on_new_request(request)
        if not self._consumers or request.request_id not in coordinator.users:
            return
        region = request.chunk_cache.question_start
        for i in self._consumers:
            tokens, _ = self._connectors[i].get_num_new_matched_tokens(request, 0)
            if tokens is not None and tokens >= region:
                self.chunk_connector.coordinator.load_elsewhere(request, tokens)
                self._requests_to_connector[request.request_id] = i
                return

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        coordinator = self.chunk_connector.coordinator
        if coordinator.is_external(request):
            loader = self._requests_to_connector[request.request_id]
            tokens, load_async = self._connectors[loader].get_num_new_matched_tokens(
                request, num_computed_tokens
            )
            if tokens is None or num_computed_tokens + tokens >= request.chunk_cache.question_start:
                return tokens, load_async
            logger.warning(
                "Chunk Cache: %s no longer loads the chunk region of %s; the chunk cache serves it",
                type(self._connectors[loader]).__name__,
                request.request_id,
            )
            coordinator.serve_here(request)
            del self._requests_to_connector[request.request_id]
        if self.chunk_connector.owns(request):
            return self.chunk_connector.get_num_new_matched_tokens(request, num_computed_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        coordinator = self.chunk_connector.coordinator
        external = coordinator.is_external(request)
        if external:
            coordinator.admitted_elsewhere(num_external_tokens)
        if external or not self.chunk_connector.owns(request):
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            return
        self.chunk_connector.update_state_after_alloc(request, blocks, num_external_tokens)
        if coordinator.private(request.request_id):
            return
        no_blocks = blocks.new_empty()
        for other in self._connectors[1:]:
            other.update_state_after_alloc(request, no_blocks, 0)

    def build_connector_meta(self, scheduler_output) -> MultiKVConnectorMetadata:
        """The chunk cache's metadata from the whole step; the other children's from the step
        without the requests they never see (`ChunkCacheCoordinator.private`)."""
        others_output = self._without_private(scheduler_output)
        metadata = MultiKVConnectorMetadata(
            metadata=(
                self.chunk_connector.build_connector_meta(scheduler_output),
                *(c.build_connector_meta(others_output) for c in self._connectors[1:]),
            )
        )
        if self._extra_async_saves:
            metadata.extra_async_saves = self._extra_async_saves
            self._extra_async_saves = {}
        return metadata

    def _without_private(self, out):
        """`out` without the private requests it schedules, preempts or finishes (the same
        object when it has none)."""
        private = self.chunk_connector.coordinator.private
        hidden = {rid for rid in out.num_scheduled_tokens if private(rid)}
        hidden |= {rid for rid in out.preempted_req_ids or () if private(rid)}
        hidden |= out.finished_req_ids & self._private_ended
        self._private_ended.clear()
        if not hidden:
            return out
        cached = out.scheduled_cached_reqs
        keep = [i for i, rid in enumerate(cached.req_ids) if rid not in hidden]
        scheduled = {rid: n for rid, n in out.num_scheduled_tokens.items() if rid not in hidden}
        return dataclasses.replace(
            out,
            scheduled_new_reqs=[r for r in out.scheduled_new_reqs if r.req_id not in hidden],
            scheduled_cached_reqs=dataclasses.replace(
                cached,
                req_ids=[cached.req_ids[i] for i in keep],
                resumed_req_ids=cached.resumed_req_ids - hidden,
                new_token_ids=[cached.new_token_ids[i] for i in keep] if cached.new_token_ids else [],
                all_token_ids={r: t for r, t in cached.all_token_ids.items() if r not in hidden},
                new_block_ids=[cached.new_block_ids[i] for i in keep],
                num_computed_tokens=[cached.num_computed_tokens[i] for i in keep],
                num_output_tokens=[cached.num_output_tokens[i] for i in keep],
            ),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens=_without(out.scheduled_spec_decode_tokens, hidden),
            scheduled_encoder_inputs=_without(out.scheduled_encoder_inputs, hidden),
            finished_req_ids=out.finished_req_ids - hidden,
            preempted_req_ids=None if out.preempted_req_ids is None else out.preempted_req_ids - hidden,
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.chunk_connector.coordinator.private(request.request_id):
            self._private_ended.add(request.request_id)
            return self.chunk_connector.request_finished(request, block_ids)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.chunk_connector.coordinator.private(request.request_id):
            self._private_ended.add(request.request_id)
            return self.chunk_connector.request_finished_all_groups(request, block_ids)
        return super().request_finished_all_groups(request, block_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker side: the step's finished requests but chunk prefills (known by their ids)."""
        return super().get_finished({r for r in finished_req_ids if not is_chunk_prefill(r)})


def _without(mapping: dict[str, Any], hidden: set[str]) -> dict[str, Any]:
    return {k: v for k, v in mapping.items() if k not in hidden}


def chunk_connector_of(connector: KVConnectorBase_V1 | None) -> ChunkCacheConnector | None:
    """The chunk cache in an engine's KV connector (the scheduler's `connector`, a worker's KV
    transfer group): the connector itself or the first child of `ChunkCacheMultiConnector`."""
    if isinstance(connector, ChunkCacheMultiConnector):
        return connector.chunk_connector
    return connector if isinstance(connector, ChunkCacheConnector) else None


def chunk_step_metadata(meta: KVConnectorMetadata | None) -> ChunkCacheStepMetadata | None:
    """The chunk cache's part of a step's KV-connector metadata (`ChunkCacheMultiConnector`'s is
    one per child, the chunk cache's first)."""
    if isinstance(meta, MultiKVConnectorMetadata):
        meta = meta.metadata[0]
    return meta if isinstance(meta, ChunkCacheStepMetadata) else None


def _single_group(kv_cache_config):
    """The one KV cache group the chunk cache works on (a model giving several is not served)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"Chunk Cache needs the model's KV cache in one group, got {len(groups)}. "
            "Set VLLM_ENABLE_CHUNK_CACHE=false to serve this model."
        )
    return groups[0]
