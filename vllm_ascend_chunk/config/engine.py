"""Engine-level set-up: wire the chunk cache into a `VllmConfig`, carve the pool out of KV memory.

`configure` runs at the end of vLLM's config post-init (patch `vllm.config.vllm`): users start
plain `vllm serve MODEL` and the connector, the scheduler class and the V1 model runner are
selected here. KV connectors the user configures (`--kv-transfer-config`: vLLM's
`MultiConnector`, or one connector) are kept next to the chunk cache (`_with_chunk_connector`).
Engines the chunk cache does not apply to (pooling, encoder-decoder, M-RoPE, and models whose
KV cache is not one group of full-attention layers: Mamba, hybrid, sliding-window) run
unpatched, with a warning; settings that conflict with it are refused with a clear error.
The decision is per engine: `configure` records the engine's settings in its config
(`config.engine_settings`), and `is_active(vllm_config)` is what every other part asks.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from vllm_ascend_chunk.config.engine_settings import (
    CONNECTOR,
    MULTI_CONNECTOR,
    engine_settings,
    is_active,
    record_pool,
    record_settings,
)
from vllm_ascend_chunk.config.pool_size import configured_pages, pool_shape, sized
from vllm_ascend_chunk.config.settings import ChunkCacheConfig, get_config
from vllm_ascend_chunk.core.geometry import AUTO_FRACTION, auto_pool_bytes
from vllm_ascend_chunk.ops.rotary import LINEAR_ROPE_TYPES

logger = logging.getLogger("vllm.chunk_cache")

LAYOUT_ENV = "VLLM_CHUNK_CACHE_LAYOUT"
CONNECTOR_MODULE = "vllm_ascend_chunk.vllm_adapter.connector"
SCHEDULERS = {
    False: "vllm_ascend_chunk.vllm_adapter.scheduler.ChunkCacheScheduler",
    True: "vllm_ascend_chunk.vllm_adapter.scheduler.ChunkCacheAsyncScheduler",
}
MODEL_FREE_SPECULATION = ("ngram",)
"""Speculative methods that propose from the token ids alone (no draft layers, no KV of their own)."""
_OFF_HINT = "Set VLLM_ENABLE_CHUNK_CACHE=false to run without the chunk cache."


class ChunkCacheSetupError(ValueError):
    """The engine configuration conflicts with the chunk cache."""


def configure(vllm_config) -> None:
    """Set the chunk cache up for this engine, or leave it off; record the engine's settings."""
    model = vllm_config.model_config
    config = get_config()
    if not config.enabled or model is None:
        return
    if (reason := _not_applicable(vllm_config)) is not None:
        logger.warning("Chunk Cache is off for this engine: %s", reason)
        return
    _refuse_conflicts(vllm_config)
    shape = pool_shape(vllm_config)  # validates the KV dtype
    _refuse_sizes_below_a_page(shape, config)
    settings = dataclasses.replace(config, layout=_layout_for(model, config))
    if (pages := configured_pages(shape, settings)) is not None:
        settings = dataclasses.replace(settings, pool=sized(shape, pages, settings))
    _decide_hma_for_the_users_connectors(vllm_config)
    vllm_config.kv_transfer_config = _with_chunk_connector(vllm_config.kv_transfer_config)
    record_settings(vllm_config, settings)
    sched = vllm_config.scheduler_config
    sched.scheduler_cls = SCHEDULERS[bool(sched.async_scheduling)]
    # vLLM's own switch (it has no config field): read in this process and the engine's.
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        logger.info("Chunk Cache selects the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
    logger.info("%s", settings.describe())


def _layout_for(model, config: ChunkCacheConfig) -> str:
    """The default layout, `sequential`, needs a RoPE that a rotation moves; for a model without
    one, an unset `VLLM_CHUNK_CACHE_LAYOUT` becomes `overlap` (which works with any positions)
    for this engine. A layout the user set is kept: the worker refuses `sequential` on such a
    model with the reason (`ChunkCacheWorker.bind_model`)."""
    layout = config.layout
    if config.layout_set or (reason := _why_not_sequential(model)) is None:
        return layout
    logger.warning(
        "Chunk Cache uses the overlap layout for this model: %s, so cached keys cannot be moved to "
        "the sequential layout's positions (the default). Set %s to silence this.",
        reason,
        LAYOUT_ENV,
    )
    return "overlap"


ROPE_AT_THE_END = (
    "its RoPE covers the last qk_rope_head_dim dims of each key head (DeepSeek's k_pe after k_nope, "
    "served as ordinary attention with VLLM_MLA_DISABLE=1), and the rotation moves the first"
)


def _why_not_sequential(model) -> str | None:
    from vllm.transformers_utils.config import is_rope_parameters_nested

    if model.using_transformers_backend():
        return "vLLM's Transformers backend applies RoPE inside modules the pool does not see"
    config = model.hf_text_config
    if getattr(config, "dual_chunk_attention_config", None):
        return "dual-chunk attention maps positions per chunk"
    if getattr(config, "qk_nope_head_dim", 0) and getattr(config, "qk_rope_head_dim", 0):
        return ROPE_AT_THE_END
    rope = getattr(config, "rope_parameters", None)
    if not rope:
        return "it has no RoPE"
    per_layer_type = rope.values() if is_rope_parameters_nested(rope) else [rope]
    types = {p.get("rope_type", "default") for p in per_layer_type}
    if other := sorted(types - LINEAR_ROPE_TYPES):
        return f"RoPE type {', '.join(other)} is not linear in the position"
    return None


def _decide_hma_for_the_users_connectors(vllm_config) -> None:
    """What vLLM decides about the hybrid KV cache manager for the user's own KV connectors.

    vLLM's post-init turns the manager off for a connector without HMA support; it runs after
    `configure` and would judge `ChunkCacheMultiConnector` (a `SupportsHMA` class) instead of the
    connectors inside it. An explicit `--no-disable-hybrid-kv-cache-manager` is refused: vLLM
    keeps it for one such connector, but a MultiConnector (which holds the chunk cache and
    the user's connector) cannot run with it.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    kv = vllm_config.kv_transfer_config
    if kv is None or kv.kv_connector in (None, CONNECTOR, MULTI_CONNECTOR):
        return
    if KVConnectorFactory.supports_hma_config(kv):
        return
    sched = vllm_config.scheduler_config
    if sched.disable_hybrid_kv_cache_manager is False:
        raise ChunkCacheSetupError(
            f"The hybrid KV cache manager was explicitly enabled, but the KV connector "
            f"{kv.kv_connector} does not support it, and the chunk cache runs next to it in a "
            "MultiConnector, which needs every connector to support it. Omit "
            f"--no-disable-hybrid-kv-cache-manager to let vLLM decide. {_OFF_HINT}"
        )
    if sched.disable_hybrid_kv_cache_manager is None:
        sched.disable_hybrid_kv_cache_manager = True
        logger.warning(
            "Turning off the hybrid KV cache manager: --kv-transfer-config selects a KV connector "
            "that does not support it (%s), as vLLM does without the chunk cache",
            kv.kv_connector,
        )


def _with_chunk_connector(kv):
    """The engine's `KVTransferConfig` with the chunk cache: `ChunkCacheConnector` alone, or the
    first child of `ChunkCacheMultiConnector` next to the user's connectors. Idempotent."""
    from vllm.config import KVTransferConfig

    if kv is None or kv.kv_connector is None:
        return KVTransferConfig(
            kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both"
        )
    if kv.kv_connector in (CONNECTOR, MULTI_CONNECTOR):
        return kv
    children = _user_connectors(kv)
    # What vLLM reads from the engine's config (not a child's) stays as the user set it: a
    # MultiConnector's own settings, or the one wrapped connector's (also in its child).
    extra = {k: v for k, v in kv.kv_connector_extra_config.items() if k != "connectors"}
    chunk_child = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
    }
    logger.info(
        "Chunk Cache runs next to the KV connectors %s (in a MultiConnector, first)",
        [f"{c.get('kv_connector')} ({c.get('kv_role')})" for c in children],
    )
    return dataclasses.replace(
        kv,
        kv_connector=MULTI_CONNECTOR,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_connector_extra_config={**extra, "connectors": [chunk_child, *children]},
    )


def _is_multi(kv) -> bool:
    """vLLM's own `MultiConnector`."""
    return kv.kv_connector == "MultiConnector" and not kv.kv_connector_module_path


def _user_connectors(kv) -> list[dict]:
    """The KV connectors the user configured, as `MultiConnector` child configs: the children of
    vLLM's MultiConnector, or the one connector (wrapped); the chunk cache is left out."""
    if kv is None or kv.kv_connector in (None, CONNECTOR, MULTI_CONNECTOR):
        return []
    if _is_multi(kv):
        children = kv.kv_connector_extra_config.get("connectors") or []
    else:
        children = [{f.name: getattr(kv, f.name) for f in dataclasses.fields(kv) if f.name != "engine_id"}]
    return [c for c in children if c.get("kv_connector") != CONNECTOR]


def _not_applicable(vllm_config) -> str | None:
    model = vllm_config.model_config
    if model.runner_type != "generate":
        return f"runner type {model.runner_type!r} (only generative models)"
    if model.is_encoder_decoder:
        return "encoder-decoder model"
    if model.uses_mrope or getattr(model, "uses_xdrope_dim", 0):
        return "multi-dimensional RoPE (M-RoPE / XD-RoPE)"
    return _not_single_kv_group(model)


# What `layer_types` may name for a layer whose KV is plain full attention.
_FULL_ATTENTION_LAYERS = frozenset({"full_attention", "attention"})


def _not_single_kv_group(model) -> str | None:
    """Why the model's layers are not all full attention with one KV spec, or None.

    The pool holds one K/V row per token for every attention layer, and the connector works on
    a single KV cache group: models whose KV cache the hybrid manager would split into several
    groups (Mamba or linear-attention layers, sliding windows, chunked local attention, layers
    with their own head counts) are not applicable.
    """
    if model.is_attention_free:
        return "attention-free model (no KV cache)"
    if model.is_hybrid:
        return "hybrid model (attention mixed with Mamba or linear-attention layers)"
    if model.has_noops:
        return "model with attention-free layers (per-layer KV geometry)"
    if model.get_sliding_window() is not None:
        return "sliding-window attention"
    if model.attention_chunk_size is not None:
        return "chunked local attention"
    other = sorted(set(getattr(model.hf_text_config, "layer_types", None) or ()) - _FULL_ATTENTION_LAYERS)
    if other:
        return f"layer types {other} (only full-attention layers)"
    return None


def _refuse_conflicts(vllm_config) -> None:
    problems = []
    spec = vllm_config.speculative_config
    if spec is not None and spec.method not in MODEL_FREE_SPECULATION:
        # The pool holds the target model's layers: a draft model's own KV of a loaded document
        # (EAGLE, MTP, draft model, Medusa...) would be missing.
        problems.append(
            f"speculative decoding with {spec.method!r} (served: {', '.join(MODEL_FREE_SPECULATION)}, "
            "which drafts from the token ids alone; the KV a draft model or head keeps of a loaded "
            "document is not in the chunk pool)"
        )
    parallel = vllm_config.parallel_config
    if parallel.prefill_context_parallel_size > 1 or parallel.decode_context_parallel_size > 1:
        problems.append("context parallelism")  # per-step positions/slots are not split per rank
    if parallel.use_ubatching:
        problems.append("dual-batch overlap (micro-batching)")  # capture indices span the batch
    if vllm_config.model_config.use_mla:
        problems.append("MLA attention")  # latent KV is never captured by the attention hook
    kv = vllm_config.kv_transfer_config
    if (
        kv is not None
        and kv.kv_load_failure_policy == "recompute"
        and any(c.get("kv_role", kv.kv_role) in ("kv_consumer", "kv_both") for c in _user_connectors(kv))
    ):
        # vLLM would compute a chunked prompt's documents whose load failed as ordinary text:
        # attending across documents, at one position shift for the whole piece.
        problems.append(
            "kv_load_failure_policy 'recompute' with a KV connector that loads ('fail', vLLM's "
            "default, ends a request whose load failed)"
        )
    sched_cls = vllm_config.scheduler_config.scheduler_cls
    if sched_cls is not None and sched_cls not in SCHEDULERS.values():
        problems.append(f"the custom scheduler {sched_cls!r}")
    if problems:
        raise ChunkCacheSetupError(f"Chunk Cache does not support {', '.join(problems)}. {_OFF_HINT}")


def _refuse_sizes_below_a_page(shape, config: ChunkCacheConfig) -> None:
    """A set size that rounds down to no page would turn its tier off without a word."""
    for name, gb in (
        ("VLLM_CHUNK_CACHE_SIZE_GB", config.size_gb),
        ("VLLM_CHUNK_CACHE_HOST_GB", config.host_gb),
    ):
        if gb and int(gb * 2**30) < shape.page_bytes:
            raise ChunkCacheSetupError(
                f"{name}={gb:g} holds no page of this model's pool: one page of {shape.page_size} tokens "
                f"takes {shape.page_bytes / 2**20:.3g} MiB. Set at least {shape.page_bytes / 2**30:.3g}"
                + (" (or 0: no host tier)." if name == "VLLM_CHUNK_CACHE_HOST_GB" else " (or unset it).")
            )


DOC_TOKENS = 512
"""Document length the start-up log counts the pool's capacity in."""


def carve_out_pool(vllm_config, executor) -> list[int]:
    """Per-worker memory for the paged KV cache once the pool is set aside (engine core): the
    pool of `VLLM_CHUNK_CACHE_SIZE_GB` (`configure` sized it), or, unset, `geometry.auto_pool_bytes`
    of the KV memory; the sized pool recorded in this engine's settings and in every worker's."""
    available = executor.determine_available_memory()
    if not is_active(vllm_config):
        return available
    settings = engine_settings(vllm_config)
    kv_bytes = min(available, default=0)
    pool, how = settings.pool, settings.pool_setting()
    if pool is None:
        shape = pool_shape(vllm_config)
        pages = auto_pool_bytes(kv_bytes) // shape.page_bytes
        how = f"auto: {AUTO_FRACTION:g} of {kv_bytes / 2**30:.2f} GiB of KV memory"
        if pages == 0:
            raise ChunkCacheSetupError(
                f"The engine has {kv_bytes / 2**30:.2f} GiB of KV memory, too little for a Chunk "
                "Cache pool. Give the KV cache more memory or set VLLM_CHUNK_CACHE_SIZE_GB."
            )
        pool = sized(shape, pages, settings)
    left = [a - pool.num_bytes for a in available]
    if min(left, default=1) <= 0:
        raise ChunkCacheSetupError(
            f"{how} leaves no memory for the paged KV cache ({kv_bytes / 2**30:.2f} GiB available "
            "in all). Lower VLLM_CHUNK_CACHE_SIZE_GB (or unset it: a share of the KV memory) or "
            "give the KV cache more memory."
        )
    record_pool(vllm_config, pool)
    executor.collective_rpc(_record_pool_in_worker, args=(pool,))
    logger.info(
        "Chunk Cache pool: %.2f GiB (%s), %d tokens: %d documents of %d tokens; "
        "%.2f GiB left for the paged KV cache",
        pool.num_bytes / 2**30,
        how,
        pool.num_rows,
        pool.num_pages // pool.pages_for(DOC_TOKENS),
        DOC_TOKENS,
        min(left) / 2**30,
    )
    return left


def _record_pool_in_worker(worker, pool) -> None:
    """Run in every worker (`collective_rpc`): a worker in another process has its own config."""
    record_pool(worker.vllm_config, pool)


def apply_ready_response(vllm_config, pool_pages: int | None) -> None:
    """Frontend: the pool size the engine core sent in its ready response (patch `core_client`),
    where the frontend does not know it yet (an auto-sized pool, an engine core in its own process)."""
    if pool_pages is None or not is_active(vllm_config):
        return
    settings = engine_settings(vllm_config)
    if settings.pool is None:
        record_pool(vllm_config, sized(pool_shape(vllm_config), pool_pages, settings))
