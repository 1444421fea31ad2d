"""Engine configuration on real `VllmConfig`s built from tiny local configs (no weights, no hub).

Models the chunk cache cannot serve (hybrid, attention-free, sliding-window, chunked local
attention, encoder-decoder with cross-attention) start with it off and one warning, and keep
vLLM's hybrid KV cache manager; models it serves keep that manager too (the connector is
`SupportsHMA`); unsupported modes are refused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_ascend_chunk.config import engine as engine_config
from vllm_ascend_chunk.config.engine_settings import SETTINGS_KEY, engine_settings
from vllm_ascend_chunk.config.settings import get_config

COMMON = {
    "vocab_size": 2048,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "float32",
}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
MAMBA_STATE = {"mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2}
NOT_APPLICABLE = {
    "mamba": (
        {
            "architectures": ["MambaForCausalLM"],
            "model_type": "mamba",
            "state_size": 8,
            "expand": 2,
            "conv_kernel": 4,
        },
        "attention-free",
    ),
    "jamba": (
        {
            "architectures": ["JambaForCausalLM"],
            "model_type": "jamba",
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 1,
            "num_experts_per_tok": 1,
            "mamba_dt_rank": 8,
            **MAMBA_STATE,
        },
        "hybrid",
    ),
    "granite-4.0-h": (
        {
            "architectures": ["GraniteMoeHybridForCausalLM"],
            "model_type": "granitemoehybrid",
            "layer_types": ["mamba", "attention"],
            "mamba_n_heads": 4,
            "mamba_d_head": 32,
            "mamba_n_groups": 1,
            "num_local_experts": 0,
            "shared_intermediate_size": 128,
            "position_embedding_type": "rope",
            **MAMBA_STATE,
        },
        "hybrid",
    ),
    "qwen3-next": (
        {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
        "hybrid",
    ),
    "mistral-sliding": (
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64},
        "sliding-window",
    ),
    "gemma2": (
        {
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "sliding_window": 64,
            "query_pre_attn_scalar": 16,
        },
        "sliding-window",
    ),
    "gpt-oss": (
        {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
        },
        "sliding-window",
    ),
    "whisper": (
        {
            "architectures": ["WhisperForConditionalGeneration"],
            "model_type": "whisper",
            "d_model": 64,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "max_target_positions": 1024,
        },
        "encoder-decoder",
    ),
    "llama4-chunked": (
        {
            "architectures": ["Llama4ForCausalLM"],
            "model_type": "llama4_text",
            "attention_chunk_size": 64,
            "intermediate_size_mlp": 128,
            "num_local_experts": 1,
            "interleave_moe_layer_step": 1,
            "no_rope_layers": [1, 1],
        },
        "chunked local attention",
    ),
}


def write_model(root: Path, tokenizer_dir: Path, config: dict) -> Path:
    """A model folder with `config.json` (no weights) and the tiny models' tokenizer."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**COMMON, **config}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, root / name)
    return root


def engine_config_of(model: Path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=512, **kwargs).create_engine_config()


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def chunk_warnings():
    """Warnings of the chunk cache's logger (vLLM's loggers do not propagate to caplog)."""
    import vllm.logger  # noqa: F401  (its logging set-up clears the handlers of "vllm.*" loggers)

    handler = Warnings()
    engine_config.logger.addHandler(handler)
    yield handler.messages
    engine_config.logger.removeHandler(handler)


@pytest.mark.parametrize("name", NOT_APPLICABLE)
def test_models_it_cannot_serve_start_with_it_off(name, tmp_path, models_dir, chunk_warnings):
    config, reason = NOT_APPLICABLE[name]
    vllm_config = engine_config_of(write_model(tmp_path / name, models_dir / "tiny-llama", config))
    assert not engine_config.is_active(vllm_config)
    assert vllm_config.kv_transfer_config is None
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert [m for m in chunk_warnings if "Chunk Cache is off" in m] == [
        f"Chunk Cache is off for this engine: {engine_config._not_applicable(vllm_config)}"
    ]
    assert reason in chunk_warnings[0]


def test_models_it_serves_keep_the_hybrid_kv_cache_manager(models_dir):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    vllm_config = engine_config_of(models_dir / "tiny-llama")
    assert engine_config.is_active(vllm_config)
    assert KVConnectorFactory.supports_hma_config(vllm_config.kv_transfer_config)
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False


def test_micro_batching_is_refused(models_dir):
    # The CPU platform turns `--enable-dbo` off before the chunk cache sees it; `ubatch_size`
    # is the other way to micro-batches (`ParallelConfig.use_ubatching`) and stays on.
    with pytest.raises(ValueError, match="does not support dual-batch overlap"):
        engine_config_of(models_dir / "tiny-llama", ubatch_size=2, all2all_backend="deepep_low_latency")


def test_dual_batch_overlap_is_refused(models_dir):
    vllm_config = engine_config_of(models_dir / "tiny-llama")
    vllm_config.parallel_config.enable_dbo = True  # as a CUDA platform leaves it
    with pytest.raises(engine_config.ChunkCacheSetupError, match="dual-batch overlap"):
        engine_config._refuse_conflicts(vllm_config)


def test_the_connector_needs_one_kv_cache_group():
    from vllm_ascend_chunk.vllm_adapter.connector import _single_group

    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))
    assert _single_group(SimpleNamespace(kv_cache_groups=[group])) is group
    with pytest.raises(ValueError, match="one group, got 2"):
        _single_group(SimpleNamespace(kv_cache_groups=[group, group]))


MOONCAKE = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
OFFLOADING = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 2**26},
}
CHUNK_CHILD = {
    "kv_connector": "ChunkCacheConnector",
    "kv_connector_module_path": "vllm_ascend_chunk.vllm_adapter.connector",
    "kv_role": "kv_both",
}


def recorded_child(vllm_config) -> dict:
    """The chunk cache's child config as `configure` leaves it: with the engine's settings."""
    return {**CHUNK_CHILD, "kv_connector_extra_config": {SETTINGS_KEY: engine_settings(vllm_config)}}


def multi(*children: dict) -> dict:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": list(children)},
    }


def test_a_multi_connector_gets_the_chunk_cache_as_its_first_child(models_dir):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_ascend_chunk.vllm_adapter.connector import ChunkCacheMultiConnector

    vllm_config = engine_config_of(models_dir / "tiny-llama", kv_transfer_config=multi(OFFLOADING, MOONCAKE))
    kv = vllm_config.kv_transfer_config
    assert engine_config.is_active(vllm_config)
    assert KVConnectorFactory.get_connector_class(kv) is ChunkCacheMultiConnector
    assert kv.kv_connector_extra_config["connectors"] == [recorded_child(vllm_config), OFFLOADING, MOONCAKE]
    assert engine_config._with_chunk_connector(kv) is kv  # configured once, whatever re-runs it
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False  # all SupportsHMA


def test_a_single_connector_is_wrapped_with_all_its_settings(models_dir):
    vllm_config = engine_config_of(
        models_dir / "tiny-llama", kv_transfer_config={**OFFLOADING, "kv_port": 4242}
    )
    kv = vllm_config.kv_transfer_config
    chunk_child, offloading = kv.kv_connector_extra_config["connectors"]
    assert (kv.kv_connector, chunk_child) == ("ChunkCacheMultiConnector", recorded_child(vllm_config))
    assert offloading == {**offloading, **OFFLOADING, "kv_port": 4242}
    assert "engine_id" not in offloading  # MultiConnector gives every child the engine's


EXAMPLE = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}


@pytest.mark.parametrize("kv", [EXAMPLE, multi(MOONCAKE, EXAMPLE)], ids=["alone", "in a MultiConnector"])
@pytest.mark.parametrize("preference", [None, True])
def test_the_hma_decision_is_vllms_for_the_users_connectors(models_dir, chunk_env, kv, preference):
    """A connector without HMA support turns the hybrid KV cache manager off, as without us."""
    decided = {}
    for enabled in ("false", "true"):
        chunk_env(VLLM_ENABLE_CHUNK_CACHE=enabled)
        vllm_config = engine_config_of(
            models_dir / "tiny-llama", kv_transfer_config=kv, disable_hybrid_kv_cache_manager=preference
        )
        assert engine_config.is_active(vllm_config) == (enabled == "true")
        decided[enabled] = vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    assert decided == {"false": True, "true": True}


def test_an_explicit_hma_next_to_a_connector_without_it_is_refused(models_dir, chunk_env):
    """vLLM keeps it for one such connector; the MultiConnector the chunk cache needs cannot run
    with it (vLLM asserts at start-up): refused with the way out."""
    explicit = {"kv_transfer_config": EXAMPLE, "disable_hybrid_kv_cache_manager": False}
    chunk_env(VLLM_ENABLE_CHUNK_CACHE="false")
    assert (
        engine_config_of(models_dir / "tiny-llama", **explicit).kv_transfer_config.kv_connector
        == "ExampleConnector"
    )
    chunk_env(VLLM_ENABLE_CHUNK_CACHE="true")
    with pytest.raises(ValueError, match="connector ExampleConnector does not support it.*Omit --no-disable"):
        engine_config_of(models_dir / "tiny-llama", **explicit)


def test_a_wrapped_connector_keeps_its_settings_in_the_engine_config(models_dir):
    """vLLM and connectors read some settings from the engine's own KV transfer config (e.g.
    MooncakeStoreConnector's `enable_cross_layers_blocks`): they stay there once wrapped."""
    settings = {"enable_cross_layers_blocks": "True", "load_async": True}
    store = {**MOONCAKE, "kv_connector_extra_config": settings}
    kv = engine_config_of(models_dir / "tiny-llama", kv_transfer_config=store).kv_transfer_config
    assert kv.kv_connector == "ChunkCacheMultiConnector"
    assert {k: kv.kv_connector_extra_config[k] for k in settings} == settings
    assert kv.kv_connector_extra_config["connectors"][1]["kv_connector_extra_config"] == settings


def test_the_chunk_cache_listed_by_the_user_moves_first(models_dir):
    vllm_config = engine_config_of(models_dir / "tiny-llama", kv_transfer_config=multi(MOONCAKE, CHUNK_CHILD))
    assert vllm_config.kv_transfer_config.kv_connector_extra_config["connectors"] == [
        recorded_child(vllm_config),
        MOONCAKE,
    ]


@pytest.mark.parametrize(
    "kv",
    [
        {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
        multi(MOONCAKE, {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}),
    ],
)
def test_disaggregated_prefill_keeps_the_users_roles(models_dir, kv):
    """A P/D instance starts with the chunk cache first; the user's connectors keep their roles
    (the engine's own role included), the chunk cache's child is `kv_both`."""
    vllm_config = engine_config_of(models_dir / "tiny-llama", kv_transfer_config=kv)
    got = vllm_config.kv_transfer_config
    children = got.kv_connector_extra_config["connectors"]
    assert got.kv_connector == "ChunkCacheMultiConnector" and children[0] == recorded_child(vllm_config)
    users = kv.get("kv_connector_extra_config", {}).get("connectors", [kv])
    assert [(c["kv_connector"], c["kv_role"]) for c in children[1:]] == [
        (c["kv_connector"], c["kv_role"]) for c in users
    ]
    assert got.kv_role == kv["kv_role"]


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_recomputing_failed_loads_is_refused_next_to_a_loading_connector(models_dir, role):
    """vLLM's `recompute` policy would compute the documents of a chunked prompt whose load
    failed as ordinary text (attending across documents, one position shift for the piece)."""
    kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "recompute"}
    with pytest.raises(ValueError, match="kv_load_failure_policy .recompute. with a KV connector that loads"):
        engine_config_of(models_dir / "tiny-llama", kv_transfer_config=kv)
    producer = {**kv, "kv_role": "kv_producer"}
    assert engine_config_of(models_dir / "tiny-llama", kv_transfer_config=producer).kv_transfer_config


def test_the_default_layout_is_sequential(models_dir, chunk_env, chunk_warnings):
    chunk_env(VLLM_CHUNK_CACHE_LAYOUT=None)
    vllm_config = engine_config_of(models_dir / "tiny-llama3")  # Llama3 rope scaling: a rotation moves it
    assert engine_settings(vllm_config).layout == "sequential"
    assert not [m for m in chunk_warnings if "layout" in m]


LONGROPE = {
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 512,
    },
    "original_max_position_embeddings": 512,
}


def test_an_unset_layout_is_overlap_for_a_rope_a_rotation_cannot_move(
    tmp_path, models_dir, chunk_env, chunk_warnings
):
    chunk_env(VLLM_CHUNK_CACHE_LAYOUT=None)
    model = write_model(tmp_path / "longrope", models_dir / "tiny-llama", {**LLAMA, **LONGROPE})
    vllm_config = engine_config_of(model)
    # The engine's config carries it to the engine core and the workers (the child config too,
    # under ChunkCacheMultiConnector); the process's settings and environment are left alone.
    assert engine_settings(vllm_config).layout == "overlap"
    assert vllm_config.kv_transfer_config.kv_connector_extra_config[SETTINGS_KEY].layout == "overlap"
    assert get_config().layout == "sequential" and "VLLM_CHUNK_CACHE_LAYOUT" not in os.environ
    assert [m for m in chunk_warnings if "overlap layout" in m] == [
        "Chunk Cache uses the overlap layout for this model: RoPE type longrope is not linear in "
        "the position, so cached keys cannot be moved to the sequential layout's positions (the "
        "default). Set VLLM_CHUNK_CACHE_LAYOUT to silence this."
    ]
    # The decision is this engine's: the next engine of the process, on a model a rotation
    # moves, keeps the default.
    assert engine_settings(engine_config_of(models_dir / "tiny-llama3")).layout == "sequential"
    next_to_another = engine_config_of(model, kv_transfer_config=multi(OFFLOADING))
    (chunk_child,) = [
        c
        for c in next_to_another.kv_transfer_config.kv_connector_extra_config["connectors"]
        if c["kv_connector"] == engine_config.CONNECTOR
    ]
    assert chunk_child["kv_connector_extra_config"][SETTINGS_KEY].layout == "overlap"


def test_a_layout_the_user_set_is_kept(tmp_path, models_dir, chunk_env, chunk_warnings):
    """The worker refuses `sequential` on such a model at start-up, with the reason (test_rotary)."""
    chunk_env(VLLM_CHUNK_CACHE_LAYOUT="sequential")
    model = write_model(tmp_path / "longrope", models_dir / "tiny-llama", {**LLAMA, **LONGROPE})
    assert engine_settings(engine_config_of(model)).layout == "sequential" and not chunk_warnings


def test_why_not_sequential_names_each_kind_of_model():
    def model(rope, backend=False, **config):
        return SimpleNamespace(
            using_transformers_backend=lambda: backend,
            hf_text_config=SimpleNamespace(rope_parameters=rope, **config),
        )

    default = {"rope_type": "default", "rope_theta": 1e4}
    assert engine_config._why_not_sequential(model(default)) is None
    assert engine_config._why_not_sequential(model({"full_attention": default})) is None
    assert "no RoPE" in engine_config._why_not_sequential(model(None))
    assert "Transformers backend" in engine_config._why_not_sequential(model(default, backend=True))
    dual = model(default, dual_chunk_attention_config={"chunk_size": 8})
    assert "dual-chunk" in engine_config._why_not_sequential(dual)
    nested = {"full_attention": default, "sliding_attention": {"rope_type": "mllama4"}}
    assert "mllama4" in engine_config._why_not_sequential(model(nested))


def test_ngram_speculation_is_served(models_dir):
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert engine_config.is_active(engine_config_of(models_dir / "tiny-llama", speculative_config=ngram))


@pytest.mark.parametrize("method", ["eagle3", "mtp", "draft_model", "medusa", "suffix"])
def test_speculation_with_draft_layers_is_refused(models_dir, method):
    vllm_config = engine_config_of(models_dir / "tiny-llama")
    vllm_config.speculative_config = SimpleNamespace(method=method)  # their drafts need weights
    with pytest.raises(engine_config.ChunkCacheSetupError) as refused:
        engine_config._refuse_conflicts(vllm_config)
    assert f"speculative decoding with '{method}'" in str(refused.value)
    assert "(served: ngram, which drafts from the token ids alone" in str(refused.value)


def test_each_pipeline_stage_keeps_the_pool_of_its_own_layers(tmp_path, models_dir):
    """A 3-layer model in two stages (vLLM splits it 2 + 1): the engine's page is sized for the
    widest stage, each worker's pool holds its stage's layers, in the same rows."""
    from vllm_ascend_chunk.config.engine_settings import pool_geometry
    from vllm_ascend_chunk.config.pool_size import pool_shape, stage_geometry

    model = write_model(tmp_path / "three", models_dir / "tiny-llama", {**LLAMA, "num_hidden_layers": 3})
    vllm_config = engine_config_of(model, pipeline_parallel_size=2, distributed_executor_backend="mp")
    assert engine_config.is_active(vllm_config)
    assert pool_shape(vllm_config).num_layers == 2
    stages = [stage_geometry(vllm_config, pp) for pp in range(2)]
    assert [s.num_layers for s in stages] == [2, 1]
    assert {s.num_pages for s in stages} == {pool_geometry(vllm_config).num_pages}
