"""ChunkCacheAsyncScheduler without a model, driven as vLLM's engine core drives it with async
scheduling: step N+1 is scheduled before the output of step N arrives (vLLM's CPU platform turns
async scheduling off, so an engine never runs this scheduler here)."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import pytest

BLOCK = 16


@pytest.fixture
def scheduler(models_dir: Path):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_ascend_chunk.scheduler.scheduler import ChunkCacheAsyncScheduler

    init_none_hash(get_hash_fn_by_name("sha256"))  # what the engine core does at start-up
    model = ModelConfig(str(models_dir / "tiny-llama"), dtype="float32", max_model_len=1024, seed=0)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK),
                        scheduler_config=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=64,
                                                         max_num_seqs=8, is_encoder_decoder=False))
    config.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layers.0", "layers.1"], spec)])
    return ChunkCacheAsyncScheduler(vllm_config=config, kv_cache_config=kv,
                                    structured_output_manager=StructuredOutputManager(config),
                                    block_size=BLOCK)


def chunked_request(scheduler, rid: str, sys_len: int, chunk_lens: list[int], question_len: int):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_ascend_chunk.frontend.keys import hash_fn, with_keys
    from vllm_ascend_chunk.metadata import ChunkCacheInfo

    info = ChunkCacheInfo(sys_len=sys_len, chunk_lens=chunk_lens, question_len=question_len)
    ids = [(7 * i) % 1000 + 1 for i in range(info.num_tokens)]
    info = with_keys(info, ids, ("tiny", "float32"), hash_fn())
    return Request(request_id=rid, prompt_token_ids=ids,
                   sampling_params=SamplingParams(max_tokens=3, temperature=0.0),
                   pooling_params=None, arrival_time=time.time(), chunk_cache=info,
                   block_hasher=scheduler._job_block_hasher)


def synthetic_output(scheduler_output, scheduler):
    """What the model runner would return: a token for every request whose prompt is done."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[r].is_prefill_chunk else [11] for r in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)


def test_chunk_prefill_preempted_before_its_output_keeps_its_entries(scheduler, caplog):
    """The last piece of a chunk prefill is scheduled (its forward runs), the prefill is
    preempted before its sampled token arrives, then the token finishes it: its K/V are complete
    and its entries must become resident, not be discarded and computed again."""
    coordinator = scheduler.chunk_cache
    user = chunked_request(scheduler, "user", sys_len=5, chunk_lens=[40, 30], question_len=4)
    scheduler.add_request(user)
    in_flight: deque = deque()
    last_piece, preempted, finished = [], [], []
    for _ in range(40):
        out = scheduler.schedule()
        in_flight.append((out, synthetic_output(out, scheduler)))
        for request in last_piece:  # preempted by this schedule(), as when blocks run out
            scheduler.running.remove(request)
            scheduler._preempt_request(request, time.monotonic())
            preempted.append(request.request_id)
        last_piece = [scheduler.requests[r] for r in out.num_scheduled_tokens
                      if r in coordinator.jobs and not scheduler.requests[r].is_prefill_chunk]
        if len(in_flight) == 2 or not out.num_scheduled_tokens:  # the output of one step back
            for eco in scheduler.update_from_output(*in_flight.popleft()).values():
                finished += [o.request_id for o in eco.outputs if o.finish_reason is not None]
        if "user" in finished:
            break
    stats = coordinator.manager.stats
    assert finished == ["user"] and len(preempted) == 2
    assert stats.chunk_prefills == 2, "the preempted prefills' chunks were computed again"
    assert all(e.resident for e in coordinator.manager.entries.values())
    assert coordinator.manager.pinned_entries == 0 and not coordinator.users and not coordinator.jobs
    assert "ended early" not in caplog.text
