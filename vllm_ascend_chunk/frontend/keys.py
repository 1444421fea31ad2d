"""Position-free content keys of SYS and of each chunk (`docs/design/design.md`, Semantics: cache keys).

`sys_key = H(namespace, engine identity (`engine_identity`: model, revision, served name, dtypes,
quantization, HF config and overrides, layout, page size, TP/PP sizes, LoRA, cache_salt), SYS ids)` and
`chunk_key_i = H(sys_key, C_i ids)`: the entry of C_i is its KV computed after SYS, so the
chunk key includes the SYS key. Nothing positional enters a key. H is vLLM's `sha256_cbor`
(or `xxhash_cbor`), as for prefix caching.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from vllm_ascend_chunk.config.engine_settings import engine_settings, is_active, pool_geometry
from vllm_ascend_chunk.config.settings import ChunkCacheConfig
from vllm_ascend_chunk.config.variables import HASH_ALGORITHMS
from vllm_ascend_chunk.core.geometry import PAGE_SIZE, PoolGeometry
from vllm_ascend_chunk.core.request_info import ChunkCacheInfo, ChunkSpans
from vllm_ascend_chunk.frontend import recovery
from vllm_ascend_chunk.frontend.parser import ChunkPromptError
from vllm_ascend_chunk.frontend.tokenize import SPANS_KEY

NAMESPACE = "vllm-ascend-chunk/v1"


def hash_fn(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM's hash function of our `algorithm` (`VLLM_CHUNK_CACHE_HASH_ALGORITHM`)."""
    from vllm.utils.hashing import get_hash_fn_by_name

    return get_hash_fn_by_name(HASH_ALGORITHMS[algorithm])


def with_keys(
    spans: ChunkSpans,
    token_ids: Sequence[int],
    identity: tuple,
    hasher: Callable[[Any], bytes],
    fraction: float = 0.0,
    runs: int = 0,
    recovered: int = 0,
    cover: float = 0.0,
    floor: float = 0.0,
) -> ChunkCacheInfo:
    """`spans` with the keys of SYS and of every chunk (and a recovery mode: `qattn`'s selection,
    `cover`'s target and floor, the number of documents `last:K` joined to the question)."""
    ids = list(token_ids)
    sys_hash = hasher((NAMESPACE, *identity, ids[: spans.sys_len]))
    chunk_hashes = [hasher((sys_hash, ids[slice(*spans.chunk_span(i))])) for i in range(spans.num_chunks)]
    return ChunkCacheInfo(
        **msgspec.structs.asdict(spans),
        sys_hash=sys_hash,
        chunk_hashes=chunk_hashes,
        fraction=fraction,
        runs=runs,
        recovered=recovered,
        cover=cover,
        floor=floor,
    )


VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path"})
"""Keys of the model's HF config that say nothing about its K/V."""


def engine_identity(vllm_config, lora_request, cache_salt: str | None) -> tuple:
    """Everything besides the tokens that can change the K/V of a chunk: two engines (or two
    instances sharing a store) exchange an entry only if all of it is equal. The weights are
    known by name and revision (and the served name: rename the model when its weights change
    in place); the TP rank is in the remote object's name (`tiers.mooncake.kv_object`)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    lora = (
        None
        if lora_request is None
        else (lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)
    )
    hf_config = {k: v for k, v in model.hf_config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    return (
        model.model,
        model.revision,
        model.served_model_name,
        model.quantization,
        str(model.model_impl),
        str(model.dtype),
        str(vllm_config.cache_config.cache_dtype),
        _canonical(model.hf_overrides),
        _canonical(hf_config),  # after the overrides: RoPE, attention, everything else
        engine_settings(vllm_config).layout,
        PAGE_SIZE,
        (parallel.tensor_parallel_size, parallel.pipeline_parallel_size),
        lora,
        cache_salt,
    )


def _canonical(value: Any) -> str:
    """A stable text of a config value (a callable `hf_overrides` by its qualified name)."""
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"
    return json.dumps(value, sort_keys=True, default=str)


PROMPT_LOGPROBS_REFUSED = (
    "Prompt logprobs (`prompt_logprobs`, or `echo` with `logprobs`) are not available for a chunked "
    "prompt: the KV of its documents is loaded from the chunk cache, not computed by this request. "
    'To get them, send the request with the chunk cache off for it: "vllm_xargs": {"chunk_cache": '
    'false} (offline: SamplingParams(extra_args={"chunk_cache": False})).'
)


def chunk_cache_info(
    engine_input: dict[str, Any], vllm_config, lora_request, params
) -> ChunkCacheInfo | None:
    """Hook for `InputProcessor.process_inputs`: the `EngineCoreRequest.chunk_cache` value."""
    if not is_active(vllm_config):
        return None
    settings = engine_settings(vllm_config)
    # Checked on ordinary prompts too: a typo is a 400.
    mode = recovery.requested_recovery(params, settings.recovery)
    spans = engine_input.get(SPANS_KEY)
    if spans is None:
        return None
    if getattr(params, "prompt_logprobs", None) is not None:
        raise ChunkPromptError(PROMPT_LOGPROBS_REFUSED)
    token_ids = engine_input.get("prompt_token_ids")
    # `frontend.tokenize.check_spans` validated the spans against these ids; an engine input
    # that did not come through it (spans of another type, other ids) is refused here.
    if (
        engine_input.get("type") != "token"
        or token_ids is None
        or not isinstance(spans, ChunkSpans)
        or len(token_ids) != spans.num_tokens
    ):
        raise ChunkPromptError("chunk spans do not match the prompt's token ids")
    check_num_docs(spans.num_chunks, settings.max_docs)
    served = recovery.apply(spans, recovery.joined_docs(mode, spans))
    identity = engine_identity(vllm_config, lora_request, engine_input.get("cache_salt"))
    recovered = spans.num_chunks - served.num_chunks
    info = with_keys(
        served,
        token_ids,
        identity,
        hash_fn(settings.hash_algorithm),
        mode.fraction,
        mode.runs,
        recovered,
        mode.cover,
        mode.floor,
    )
    check_fits(info, pool_geometry(vllm_config), settings)
    return info


def check_num_docs(num_docs: int, max_docs: int) -> None:
    """Refuse a request that brings more documents than the operator allows (`VLLM_CHUNK_CACHE_MAX_DOCS`)."""
    if num_docs > max_docs:
        raise ChunkPromptError(
            f"This request brings {num_docs} documents; VLLM_CHUNK_CACHE_MAX_DOCS={max_docs} allows at "
            "most that many in one request. Send fewer documents, or raise VLLM_CHUNK_CACHE_MAX_DOCS."
        )


def check_fits(info: ChunkCacheInfo, geometry: PoolGeometry, settings: ChunkCacheConfig) -> None:
    """Refuse a chunk set that could never be resident in the pool all at once, or that would hold
    more of it than one request may (`VLLM_CHUNK_CACHE_MAX_REQUEST_TOKENS`)."""
    max_request_tokens = settings.max_request_tokens
    unique = {info.sys_hash: info.sys_len, **dict(zip(info.chunk_hashes, info.chunk_lens, strict=True))}
    rows = sum(geometry.pages_for(n) for n in unique.values()) * geometry.page_size
    need = f"The system prompt and distinct documents of this request need {rows} tokens of chunk pool"
    if rows > geometry.num_rows:
        raise ChunkPromptError(
            f"{need}, but {settings.pool_setting()} holds {geometry.num_rows}. "
            "Send fewer or shorter documents, or raise VLLM_CHUNK_CACHE_SIZE_GB."
        )
    if rows > max_request_tokens:
        raise ChunkPromptError(
            f"{need} (each rounded up to {geometry.page_size}-token pages); "
            f"VLLM_CHUNK_CACHE_MAX_REQUEST_TOKENS={max_request_tokens} allows one request at most "
            "that many, so that no request flushes the pool for the others. Send fewer or shorter "
            "documents, or raise VLLM_CHUNK_CACHE_MAX_REQUEST_TOKENS."
        )
