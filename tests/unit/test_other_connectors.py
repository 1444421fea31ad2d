"""What another KV connector sees next to the chunk cache (`ChunkCacheMultiConnector`), with the
real scheduler and vLLM's real connectors in their scheduler role (no device, no network).

It never sees a chunk prefill (an internal request: P2P-NCCL parses a peer address out of every
request id it sends), nor a chunk-path request with a recovery mode or a `cache_salt` (a
connector keying KV by token ids would take its KV for another request's). On a P/D decode
instance the chunk cache serves those itself; a plain chunk-path request is loaded by the
consumer (`kv_consumer`, or `kv_both` as NIXL is often configured), and counted as an external
load once it is admitted."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.unit.test_async_scheduler import BLOCK, TOKEN, make_scheduler, synthetic_output
from vllm_ascend_chunk.config.settings import get_config
from vllm_ascend_chunk.core.request_info import ChunkSpans
from vllm_ascend_chunk.scheduler.prefills import is_chunk_prefill

PEER = "___prefill_addr_127.0.0.1:21001___decode_addr_127.0.0.1:22001_"
"""How vLLM's P2P-NCCL proxy names a request: both peers' addresses in its id."""
PRIVATE = ("qattn", "last", "salted")
PUBLIC = ("plain", "ordinary")


def scheduler_next_to(models_dir: Path, **kv):
    """A `ChunkCacheScheduler` next to the KV connector `kv` (a `KVTransferConfig`'s fields)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    from vllm_ascend_chunk.vllm_adapter.scheduler import ChunkCacheScheduler

    config = VllmConfig(
        model_config=ModelConfig(str(models_dir / "tiny-llama"), dtype="float32", max_model_len=1024),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(**kv),
        scheduler_config=SchedulerConfig(
            max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=8, is_encoder_decoder=False
        ),
    )
    config.cache_config.num_gpu_blocks = 64
    return make_scheduler(config, ChunkCacheScheduler)


def request(scheduler, kind: str):
    """A request of `kind` whose id names the P2P peers."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_ascend_chunk.frontend.keys import hash_fn, with_keys

    docs = [40, 30, 50] if kind != "last" else [40, 30]  # `last:1`: the third joined the question
    spans = ChunkSpans(sys_len=5, chunk_lens=docs, question_len=10 if kind != "last" else 60)
    ids = [(7 * i) % 1000 + 1 for i in range(spans.num_tokens)]
    select = {"fraction": 0.3, "runs": 2} if kind == "qattn" else {}
    recovered = 1 if kind == "last" else 0
    info = with_keys(
        spans, ids, ("tiny", "float32"), hash_fn(get_config().hash_algorithm), recovered=recovered, **select
    )
    return Request(
        request_id=f"cmpl-{PEER}{kind}",
        prompt_token_ids=ids if kind != "ordinary" else ids[:50],
        sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
        pooling_params=None,
        arrival_time=time.time(),
        chunk_cache=None if kind == "ordinary" else info,
        cache_salt="tenant-b" if kind == "salted" else None,
        block_hasher=scheduler._prefill_block_hasher,
    )


def spy(connector) -> dict[str, set[str]]:
    """Record every request id `connector` is told about, per method."""
    seen: dict[str, set[str]] = defaultdict(set)

    def wrap(name, ids_of):
        original = getattr(connector, name)

        def recorded(*args, **kwargs):
            seen[name] |= set(ids_of(*args))
            return original(*args, **kwargs)

        setattr(connector, name, recorded)

    def step_ids(out, *_):
        cached = out.scheduled_cached_reqs
        return [
            *(r.req_id for r in out.scheduled_new_reqs),
            *cached.req_ids,
            *out.num_scheduled_tokens,
            *out.finished_req_ids,
            *(out.preempted_req_ids or ()),
        ]

    for name in (
        "on_new_request",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "request_finished",
    ):
        wrap(name, lambda req, *_: [req.request_id])
    wrap("build_connector_meta", step_ids)
    return seen


def serve(scheduler, kinds) -> dict[str, list[int]]:
    """Every request to its end, one step at a time (scores reported for `qattn` requests); the
    tokens each client got. Every request id P2P-NCCL puts in a step's metadata names its peers."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.p2p.p2p_nccl_connector import P2pNcclConnector
    from vllm.v1.outputs import KVConnectorOutput

    from vllm_ascend_chunk.core.step import ChunkCacheWorkerMetadata
    from vllm_ascend_chunk.vllm_adapter.connector import chunk_step_metadata

    p2p = isinstance(scheduler.connector._connectors[1], P2pNcclConnector)
    for kind in kinds:
        scheduler.add_request(request(scheduler, kind))
    tokens: dict[str, list[int]] = defaultdict(list)
    for _ in range(100):
        if not scheduler.has_requests():
            break
        out = scheduler.schedule()
        for sent in out.kv_connector_metadata.metadata[1].requests if p2p else ():
            P2pNcclConnector.parse_request_id(sent.request_id, True)
            P2pNcclConnector.parse_request_id(sent.request_id, False)
        output = synthetic_output(out, scheduler, TOKEN)
        specs = chunk_step_metadata(out.kv_connector_metadata).scores
        report = ChunkCacheWorkerMetadata(scores={rid: [1.0] * 120 for rid in specs})
        output.kv_connector_output = KVConnectorOutput(
            kv_connector_worker_meta=MultiKVConnectorWorkerMetadata(metadata=(report, None))
        )
        for eco in scheduler.update_from_output(out, output).values():
            for o in eco.outputs:
                tokens[o.request_id.removeprefix(f"cmpl-{PEER}")] += o.new_token_ids
    assert not scheduler.has_requests()
    return dict(tokens)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_other_connectors_never_see_the_chunk_caches_own_requests(models_dir: Path, role: str):
    scheduler = scheduler_next_to(models_dir, kv_connector="P2pNcclConnector", kv_role=role)
    seen = spy(scheduler.connector._connectors[1])
    coordinator = scheduler.connector.chunk_connector.coordinator
    tokens = serve(scheduler, PUBLIC + PRIVATE)
    assert tokens == {kind: [TOKEN] for kind in PUBLIC + PRIVATE}  # P/D: one token each
    names = {rid for ids in seen.values() for rid in ids}
    assert not [rid for rid in names if is_chunk_prefill(rid)], "a chunk prefill reached P2P-NCCL"
    assert {rid.removeprefix(f"cmpl-{PEER}") for rid in names} == set(PUBLIC)
    stats = coordinator.manager.stats
    assert stats.selections == 1  # the `qattn` request recomputed its runs, wherever it ran
    # P2P-NCCL loads every prompt as a consumer (`kv_both` is a producer to it): the plain one
    # is loaded there, not computed
    assert stats.external_loads == (role == "kv_consumer")


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_a_connector_holding_the_prompt_loads_it_in_either_loading_role(
    models_dir: Path, tmp_path, role: str
):
    """`ExampleConnector` holding a plain chunked prompt's KV (as a P/D prefill instance left it)
    loads it as `kv_consumer` or `kv_both`; a `qattn` request of the same ids is served here."""
    import torch

    scheduler = scheduler_next_to(
        models_dir,
        kv_connector="ExampleConnector",
        kv_role=role,
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    example = scheduler.connector._connectors[1]
    plain, qattn = request(scheduler, "plain"), request(scheduler, "qattn")
    ids = plain.prompt_token_ids
    example._generate_foldername_debug(
        torch.tensor(ids[: (len(ids) - 2) // BLOCK * BLOCK]), [], create_folder=True
    )
    assert qattn.prompt_token_ids == ids
    tokens = serve(scheduler, ["plain"])
    coordinator = scheduler.connector.chunk_connector.coordinator
    assert tokens == {"plain": [TOKEN]}
    assert (coordinator.manager.stats.external_loads, coordinator.manager.stats.chunk_prefills) == (1, 0)
    assert serve(scheduler, ["qattn"]) == {"qattn": [TOKEN]}
    assert coordinator.manager.stats.external_loads == 1 and coordinator.manager.stats.chunk_prefills > 0
