"""A model the chunk cache cannot serve, started for real: it generates as vLLM runs it, with the
answer of transformers. Its configuration without an engine: `tests/unit/test_engine_config.py`."""

from __future__ import annotations

from tests.helpers.engine_runner import run_engine
from tests.unit.test_engine_config import NOT_APPLICABLE, write_model


def test_a_sliding_window_model_generates_with_it_off(tmp_path, models_dir):
    """A real engine start: the model runs as vLLM runs it, with the answer of transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness import hf_reference

    config, _ = NOT_APPLICABLE["mistral-sliding"]
    # The CPU attention kernels need a head size of 32 or more.
    model_dir = write_model(
        tmp_path / "mistral", models_dir / "tiny-llama", {**config, "hidden_size": 128, "head_dim": 32}
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(model_dir)
    prompt = "An ordinary prompt about ferries."
    result = run_engine(model_dir, [{"prompts": [prompt], "max_tokens": 4}], engine={"max_model_len": 256})
    got = result["rounds"][0][0]
    assert result["states"] == [{"preemptions": 0}], "no chunk cache in this engine"
    want = hf_reference.greedy(hf_reference.load(model_dir), got["prompt_ids"], 4)
    assert got["tokens"] == want.tokens
