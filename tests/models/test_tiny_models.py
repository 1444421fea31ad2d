"""The offline tiny models: byte-identical generation, one tokenization on every loading path,
sharp logits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts import make_tiny_models
from tests.helpers import REPO

TINY = ["tiny-llama", "tiny-qwen2", "tiny-llama3"]
FAMILIES = sorted(make_tiny_models.FAMILY_MODELS)
TEXTS = make_tiny_models.synthetic_corpus(seed=7, n_lines=200) + [
    "",
    " ",
    "  two  spaces\tand tab\nnewline\r\n",
    "café naïve Straße",
    "日本語の文書を検索",
    "😀🚀 emoji",
    "e\u0301 combining",
    "ＡＢＣ full width",
    "'s 're 've",
    "x # # y # #z",
    "\x00\x07 control",
]


def test_generation_is_byte_identical(models_dir: Path, tmp_path: Path):
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "make_tiny_models.py"),
            "--out",
            str(tmp_path),
            "--force",
            "--only",
            *TINY,
            *FAMILIES,
        ],
        check=True,
        capture_output=True,
    )
    for name in TINY + FAMILIES:
        assert make_tiny_models.digest(tmp_path / name) == make_tiny_models.digest(models_dir / name)


@pytest.mark.parametrize("name", TINY + FAMILIES + ["bench-llama"])
def test_every_loading_path_gives_the_same_ids(models_dir: Path, name: str):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer

    raw = Tokenizer.from_file(str(models_dir / name / "tokenizer.json"))
    loaders = [AutoTokenizer.from_pretrained(models_dir / name), get_tokenizer(str(models_dir / name))]
    bos = raw.token_to_id(make_tiny_models.BOS)
    for text in TEXTS:
        with_bos, without = raw.encode(text).ids, raw.encode(text, add_special_tokens=False).ids
        assert with_bos == [bos] + without
        for tok in loaders:
            assert tok.encode(text) == with_bos, (type(tok).__name__, text)
            assert tok.encode(text, add_special_tokens=False) == without, (type(tok).__name__, text)


@pytest.mark.parametrize("name", TINY + FAMILIES)
def test_logits_have_no_near_ties(models_dir: Path, name: str):
    report = make_tiny_models.logit_gap_report(models_dir / name)
    assert report["min"] > 1e-3 and report["p50"] > 1.0, report


def test_architectures(models_dir: Path):
    import json

    llama = json.loads((models_dir / "tiny-llama" / "config.json").read_text())
    qwen = json.loads((models_dir / "tiny-qwen2" / "config.json").read_text())
    assert llama["architectures"] == ["LlamaForCausalLM"] and qwen["architectures"] == ["Qwen2ForCausalLM"]
    for cfg in (llama, qwen):
        assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
        assert cfg["torch_dtype"] == "float32"


# What each family model must have for its cell of the matrix (docs/user/models.md) to mean anything.
FAMILY_TRAITS = {
    "tiny-qwen3": ("Qwen3ForCausalLM", {}),
    "tiny-qwen3-moe": ("Qwen3MoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "tiny-glm4": ("Glm4ForCausalLM", {"partial_rotary_factor": 0.5}),
    "tiny-phi3": ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75}),
    "tiny-mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "tiny-granite": ("GraniteForCausalLM", {"embedding_multiplier": 6.0, "logits_scaling": 2.0}),
    "tiny-olmo2": ("Olmo2ForCausalLM", {}),
    "tiny-gemma2-sw": ("Gemma2ForCausalLM", {"sliding_window": 64}),
    "tiny-mistral-sw": ("MistralForCausalLM", {"sliding_window": 64}),
    "tiny-gpt-oss": ("GptOssForCausalLM", {"sliding_window": 64, "num_local_experts": 4}),
    "tiny-deepseek-v2": ("DeepseekV2ForCausalLM", {"kv_lora_rank": 64, "qk_rope_head_dim": 32}),
    "tiny-qwen3-next": ("Qwen3NextForCausalLM", {"layer_types": ["linear_attention", "full_attention"]}),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_family_architectures(models_dir: Path, name: str):
    import json

    cfg = json.loads((models_dir / name / "config.json").read_text())
    arch, fields = FAMILY_TRAITS[name]
    assert cfg["architectures"] == [arch]
    assert (cfg["num_attention_heads"], cfg["head_dim"]) == (4, 32)  # the CPU attention's smallest head
    assert cfg["num_key_value_heads"] == (4 if name == "tiny-deepseek-v2" else 2)  # GQA but MLA
    assert {k: cfg.get(k, cfg.get("rope_parameters", {}).get(k)) for k in fields} == fields
