"""The config-only model shapes (`scripts/make_dummy_shapes.py`): transformers builds each one, with
the published parameter count, and every id of the shared tokenizer fits its vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import make_dummy_shapes


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shapes")
    assert make_dummy_shapes.main(["--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("name", sorted(make_dummy_shapes.PUBLISHED_PARAMETERS))
def test_each_shape_has_its_published_parameter_count(shapes: Path, name: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(shapes / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    count = sum(p.numel() for p in model.parameters())
    assert count == pytest.approx(make_dummy_shapes.PUBLISHED_PARAMETERS[name], rel=0.01)
    assert type(model).__name__ == cfg.architectures[0]


def test_the_directories_hold_no_weights_and_a_tokenizer_that_fits(shapes: Path):
    from transformers import AutoTokenizer

    for name in make_dummy_shapes.SHAPES:
        d = shapes / name
        assert sorted(p.name for p in d.iterdir()) == [
            "GENERATOR_VERSION",
            "config.json",
            "generation_config.json",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
        cfg = json.loads((d / "config.json").read_text())
        tok = AutoTokenizer.from_pretrained(d)
        assert len(tok) <= cfg["vocab_size"] and tok.model_max_length == cfg["max_position_embeddings"]
        assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])


def test_an_up_to_date_shape_is_not_written_again(shapes: Path, capsys):
    make_dummy_shapes.main(["--out", str(shapes), "--only", "dummy-tiny-llama3.1"])
    assert "up to date" in capsys.readouterr().out
