"""Every setting that can change a document's K/V changes its key (`frontend.keys.engine_identity`):
two engines, or two instances sharing a store, exchange an entry only when all of them are equal.
Real `VllmConfig`s of the tiny Llama; each case changes one thing."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from tests.unit.test_engine_config import engine_config_of
from vllm_ascend_chunk.config.settings import get_config
from vllm_ascend_chunk.core.request_info import ChunkSpans
from vllm_ascend_chunk.frontend.keys import engine_identity, hash_fn, with_keys

LORA = SimpleNamespace(lora_name="adapter", lora_int_id=1, lora_path="/adapters/a")


def keys(vllm_config, lora=None, salt=None) -> tuple[bytes, bytes]:
    spans = ChunkSpans(sys_len=2, chunk_lens=[3], question_len=1)
    info = with_keys(
        spans,
        [5, 6, 7, 8, 9, 10],
        engine_identity(vllm_config, lora, salt),
        hash_fn(get_config().hash_algorithm),
    )
    return info.sys_hash, info.chunk_hashes[0]


def changed(base, **fields):
    """A copy of the config with `section.field` values replaced (`model_config__revision=...`)."""
    config = copy.deepcopy(base)
    for path, value in fields.items():
        section, name = path.split("__")
        setattr(getattr(config, section), name, value)
    return config


@pytest.fixture(scope="module")
def base(models_dir):
    return engine_config_of(models_dir / "tiny-llama")


def test_the_same_settings_give_the_same_keys(base, models_dir):
    assert keys(base) == keys(engine_config_of(models_dir / "tiny-llama"))
    assert keys(base, LORA, "salt") == keys(copy.deepcopy(base), SimpleNamespace(**vars(LORA)), "salt")


@pytest.mark.parametrize(
    "what",
    [
        "model",
        "revision",
        "served name",
        "quantization",
        "model implementation",
        "dtype",
        "KV cache dtype",
        "hf_overrides",
        "RoPE in the HF config",
        "TP size",
        "PP size",
    ],
)
def test_each_engine_setting_changes_the_keys(base, what):
    import torch

    rope = copy.deepcopy(base)
    rope.model_config.hf_config.rope_parameters = {"rope_type": "default", "rope_theta": 1234.0}
    other = {
        "model": lambda: changed(base, model_config__model="/models/another"),
        "revision": lambda: changed(base, model_config__revision="v2"),
        "served name": lambda: changed(base, model_config__served_model_name="tiny-llama-v2"),
        "quantization": lambda: changed(base, model_config__quantization="awq"),
        "model implementation": lambda: changed(base, model_config__model_impl="transformers"),
        "dtype": lambda: changed(
            base,
            model_config__dtype=torch.float16 if base.model_config.dtype != torch.float16 else torch.float32,
        ),
        "KV cache dtype": lambda: changed(base, cache_config__cache_dtype="fp8"),
        "hf_overrides": lambda: changed(base, model_config__hf_overrides={"rope_theta": 5000.0}),
        "RoPE in the HF config": lambda: rope,
        "TP size": lambda: changed(base, parallel_config__tensor_parallel_size=2),
        "PP size": lambda: changed(base, parallel_config__pipeline_parallel_size=2),
    }[what]()
    sys_key, chunk_key = keys(other)
    assert sys_key != keys(base)[0] and chunk_key != keys(base)[1]


def test_lora_salt_and_layout_change_the_keys(base, models_dir, chunk_env):
    chunk_env(VLLM_CHUNK_CACHE_LAYOUT=None)
    plain = keys(base)
    variants = [
        keys(base, LORA),
        keys(base, SimpleNamespace(**{**vars(LORA), "lora_path": "/adapters/retrained"})),  # same name, id
        keys(base, SimpleNamespace(**{**vars(LORA), "lora_int_id": 2})),
        keys(base, salt="tenant-a"),
    ]
    chunk_env(VLLM_CHUNK_CACHE_LAYOUT="overlap")  # not the default: an engine configured with it
    variants.append(keys(engine_config_of(models_dir / "tiny-llama")))
    assert len({plain, *variants}) == 1 + len(variants)
