"""The patched `EngineCoreRequest` carries `ChunkCacheInfo` through msgpack into the engine core's
`Request` (no engine)."""

from __future__ import annotations

import msgspec


def test_engine_core_request_round_trips_chunk_metadata():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    from vllm_ascend_chunk.core.request_info import ChunkCacheInfo

    info = ChunkCacheInfo(
        sys_len=3, chunk_lens=[2, 4], question_len=3, sys_hash=b"s", chunk_hashes=[b"a", b"b"]
    )
    req = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=list(range(12)),
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        chunk_cache=info,
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert decoded.chunk_cache == info
    assert Request.from_engine_core_request(decoded, None).chunk_cache == info
    assert info.chunk_span(1) == (5, 9) and info.question_start == 9

    plain = msgspec.structs.replace(req, chunk_cache=None)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(plain), type=EngineCoreRequest)
    assert decoded.chunk_cache is None
