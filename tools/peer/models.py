"""Local stand-ins for the hub models that vLLM's peer tests name, so that offline the tests build
their `ModelConfig`s and the chunk cache meets a model (`tools.peer.vllm_peer_tests`).

Each is a `config.json` in a Hugging Face cache folder (`HF_HOME`), as the hub would have cached
it: the architecture and the shape of the real model (layers, heads, vocabulary, context), no
weights and no tokenizer, so a test that loads either fails in every mode alike. Models the
chunk cache does not serve (sliding window, Mamba, encoder-decoder, vision-language) are here too:
the tests that use them show that it stays off for them.
"""

from __future__ import annotations

from pathlib import Path

REVISION = "0" * 40
"""The snapshot every stand-in is cached under (`refs/main`)."""

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
OPT_350M = {
    "hidden_size": 1024,
    "ffn_dim": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "torch_dtype": "float16",
}

MODELS: dict[str, tuple[str, dict]] = {
    # Decoder-only language models: the chunk cache is on for them.
    "facebook/opt-125m": ("opt", {"architectures": ["OPTForCausalLM"], "torch_dtype": "float16"}),
    "facebook/opt-350m": (
        "opt",
        {"architectures": ["OPTForCausalLM"], "word_embed_proj_dim": 512, **OPT_350M},
    ),
    "meta-llama/Llama-3.2-1B": ("llama", LLAMA_3_2_1B),
    "meta-llama/Llama-3.2-1B-Instruct": ("llama", LLAMA_3_2_1B),
    "hmellor/tiny-random-LlamaForCausalLM": (
        "llama",
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 16,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
            "max_position_embeddings": 2048,
        },
    ),
    "Qwen/Qwen3-0.6B": (
        "qwen3",
        {
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
        },
    ),
    "Qwen/Qwen1.5-7B": (
        "qwen2",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "torch_dtype": "bfloat16",
        },
    ),
    "mistralai/Mistral-7B-v0.1": (
        "mistral",
        {"architectures": ["MistralForCausalLM"], "sliding_window": None},
    ),
    # Models the chunk cache does not serve: it stays off for them, with one warning.
    "google/gemma-3-1b-it": (
        "gemma3_text",
        {
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_size": 1152,
            "num_hidden_layers": 26,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "sliding_window": 512,
            "vocab_size": 262144,
        },
    ),
    "state-spaces/mamba-130m-hf": ("mamba", {"architectures": ["MambaForCausalLM"]}),
    "openai/whisper-small": ("whisper", {"architectures": ["WhisperForConditionalGeneration"]}),
    "llava-hf/llava-1.5-7b-hf": ("llava", {"architectures": ["LlavaForConditionalGeneration"]}),
}


def write_cache(home: Path) -> Path:
    """Write every stand-in under `home` (an `HF_HOME`); returns `home`. Idempotent."""
    from transformers import AutoConfig

    for repo_id, (model_type, fields) in MODELS.items():
        repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        AutoConfig.for_model(model_type, **fields).save_pretrained(snapshot)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
    return home
