#!/usr/bin/env python3
"""Write config-only model directories of real models' shapes, for `vllm serve --load-format dummy`.

vLLM's dummy loader draws random weights from `config.json` alone, so an 8B or 32B shape needs no
checkpoint: each directory holds the real model's published config values (`SHAPES`), the tiny
models' tokenizer (`make_tiny_models.build_tokenizer`: 2,048 ids, fewer than any real vocabulary,
so every id it makes fits) and no weights (a few hundred KB each). Random weights: TTFT and
throughput are the real shape's, the answers are noise.

    python scripts/make_dummy_shapes.py [--out DIR] [--only NAME ...]

Shapes written under DIR (default: `$CHUNK_CACHE_MODELS_DIR` or `<repo>/.models`):
  dummy-llama3.1-8b     Llama-3.1-8B: 32 layers, 4096 wide, GQA 32/8, head_dim 128, llama3 RoPE
  dummy-qwen3-8b        Qwen3-8B: 36 layers, 4096 wide, GQA 32/8, q/k norms
  dummy-qwen2.5-32b     Qwen2.5-32B: 64 layers, 5120 wide, GQA 40/8, qkv bias
  dummy-qwen3-30b-a3b   Qwen3-30B-A3B: 48 layers, 2048 wide, 128 experts, 8 per token (needs
                        vLLM's `_moe_C` on CUDA, which the offline GPU bundle leaves out)
  dummy-tiny-llama3.1   the Llama-3.1 code path at tiny dims (2 layers, 256 wide, a 32,768 vocab),
                        for the CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from scripts.make_tiny_models import (  # noqa: E402
    BOS,
    EOS,
    PAD,
    build_tokenizer,
    is_current,
    publish,
    write_tokenizer,
)

DEFAULT_OUT = Path(os.environ.get("CHUNK_CACHE_MODELS_DIR", REPO / ".models"))
GENERATOR_VERSION = "1"
"""Bump when anything below changes the written bytes."""

_LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
}
_QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 36,
}

SHAPES: dict[str, dict] = {
    "dummy-llama3.1-8b": _LLAMA31_8B,
    "dummy-qwen3-8b": _QWEN3_8B,
    "dummy-qwen2.5-32b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 64,
    },
    "dummy-qwen3-30b-a3b": {
        **_QWEN3_8B,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "max_window_layers": 48,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "dummy-tiny-llama3.1": {
        **_LLAMA31_8B,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 32768,
    },
}
"""The published config values of each shape (the real `config.json`'s, token ids aside)."""

PUBLISHED_PARAMETERS = {
    "dummy-llama3.1-8b": 8.03e9,
    "dummy-qwen3-8b": 8.19e9,
    "dummy-qwen2.5-32b": 32.8e9,  # its checkpoint's count (the card rounds it to 32.5B)
    "dummy-qwen3-30b-a3b": 30.5e9,
}
"""The parameter counts the models' pages state (a unit test holds the shapes to them, within 1 %)."""


def config_of(name: str, tok) -> dict:
    """The `config.json` of shape `name`: its published values, this tokenizer's special ids."""
    return {
        **SHAPES[name],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "pad_token_id": tok.token_to_id(PAD),
    }


def write_shape(name: str, tok, out: Path) -> None:
    """The directory of shape `name`: config, generation config, tokenizer, no weights."""
    cfg = config_of(name, tok)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        d = Path(tmp)
        (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} | {"do_sample": False}
        (d / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        write_tokenizer(tok, d, max_length=cfg["max_position_embeddings"])
        publish(d, out / name, GENERATOR_VERSION)


def main(argv: list[str] | None = None) -> int:
    """Write the shapes asked for (default all) that are missing or out of date."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", choices=sorted(SHAPES), help="shapes to write (default all)")
    ap.add_argument("--force", action="store_true", help="write even if up to date")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(SHAPES)
    todo = [n for n in names if args.force or not is_current(args.out / n, GENERATOR_VERSION)]
    tok = build_tokenizer() if todo else None
    for name in names:
        if name in todo:
            write_shape(name, tok, args.out)
            print(f"wrote {args.out / name}")
        else:
            print(f"up to date: {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
