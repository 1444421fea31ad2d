"""Entry points for the vLLM patches on the worker side (model runner)."""

from __future__ import annotations


def _chunk_worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return getattr(get_kv_transfer_group(), "chunk_worker", None) if has_kv_transfer_group() else None


def prepare_step(runner, scheduler_output, num_reqs: int, num_tokens: int) -> None:
    """`GPUModelRunner._prepare_inputs`, right after the slot mapping is computed."""
    from vllm_ascend_chunk.step import ChunkCacheStepMetadata

    meta = scheduler_output.kv_connector_metadata
    if isinstance(meta, ChunkCacheStepMetadata) and (worker := _chunk_worker()) is not None:
        worker.prepare_step(runner, meta, num_reqs, num_tokens)


def bind_model(model) -> None:
    """`GPUModelRunner.initialize_kv_cache`, after the KV caches are registered (start-up)."""
    if (worker := _chunk_worker()) is not None:
        worker.bind_model(model)
