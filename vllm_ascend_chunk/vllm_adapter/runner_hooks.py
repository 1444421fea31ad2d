"""Entry points for the vLLM patches on the worker side (model runner).

The worker side's vLLM adapter, beside the connector (the logic is in `worker/`). The hooks find
this worker's chunk cache the way vLLM's runner finds its KV connector (the KV transfer group, in
which `connector.chunk_connector_of` finds it), and hand it what it needs as explicit values.
`prepare_step` reads the step metadata from the scheduler output: positions are prepared before
vLLM binds the metadata to the connector (around the forward), where `start_load_kv` and
`wait_for_save` read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_ascend_chunk.worker.chunk_worker import ChunkCacheWorker


def _chunk_worker() -> ChunkCacheWorker | None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from vllm_ascend_chunk.vllm_adapter.connector import chunk_connector_of

    connector = chunk_connector_of(get_kv_transfer_group() if has_kv_transfer_group() else None)
    return connector.chunk_worker if connector is not None else None


def prepare_step(runner, scheduler_output, num_reqs: int, num_tokens: int) -> None:
    """`GPUModelRunner._prepare_inputs` (vllm-ascend: `NPUModelRunner`), right after the slot
    mapping is computed from the logical positions: the RoPE positions of this step's tokens, and
    the batch rows of the `qattn` question pieces to score."""
    from vllm_ascend_chunk.vllm_adapter.connector import chunk_step_metadata

    meta = chunk_step_metadata(scheduler_output.kv_connector_metadata)
    if meta is None or not meta.position_shifts or (worker := _chunk_worker()) is None:
        return
    req_ids, query_starts = runner.input_batch.req_ids[:num_reqs], runner.query_start_loc.np[: num_reqs + 1]
    worker.shift_positions(meta.position_shifts, req_ids, query_starts, runner.positions[:num_tokens])
    if meta.scores:
        worker.plan_scores(meta.scores, req_ids, query_starts)


def bind_model(model) -> None:
    """`GPUModelRunner.initialize_kv_cache`, after the KV caches are registered (start-up): the
    model's RoPE, and the attention layer that scores `qattn` questions."""
    if (worker := _chunk_worker()) is not None:
        worker.bind_model(model)
        worker.bind_scorer()
