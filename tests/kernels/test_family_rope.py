"""The rotary correction on each family's RoPE, against HF transformers' own (the family module's
rotary embedding and `apply_rotary_pos_emb`, never the code under test): a key HF rotated to
position p, moved by the op by d, equals HF's key at p + d. GLM-4 rotates interleaved pairs of
half of each head, Phi-3 (as Phi-4-mini) three quarters; DeepSeek's MLA cache holds one latent
vector per token, `kv_lora_rank` position-free dims then the rotated `k_pe` (interleaved pairs,
YaRN): the op moves `k_pe` in place, as a view of the row's last dims, and leaves the latent
part bit-identical."""

from __future__ import annotations

import pytest
import torch

from harness import hf_reference
from vllm_ascend_chunk.ops.rotary import rerotate_keys, rerotate_keys_, rotary_spec_from_vllm

from .test_rotary import _construct

# vLLM's pair layout per family (glm4.py: is_neox_style=False; the others the default).
NEOX = {
    "tiny-qwen3": True,
    "tiny-qwen3-moe": True,
    "tiny-glm4": False,
    "tiny-phi3": True,
    "tiny-mistral": True,
    "tiny-granite": True,
    "tiny-olmo2": True,
}
POSITIONS = torch.tensor([0, 1, 7, 64, 300, 1000, 1024, 2048])


def vllm_spec(head_size: int, neox: bool, rope_parameters: dict):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = dict(rope_parameters)
    rope = _construct(lambda: get_rope(head_size, 16384, neox, params, dtype=torch.float32))
    return rotary_spec_from_vllm(rope)


@pytest.mark.parametrize("name", list(NEOX))
def test_family_rope_moves_as_hf_rotates(models_dir, name: str):
    model = hf_reference.load(models_dir / name)
    cfg, rope = model.config, hf_reference.family_rope(model)
    spec = vllm_spec(cfg.head_dim, NEOX[name], cfg.rope_parameters)
    gen = torch.Generator().manual_seed(len(name))
    k0 = torch.randn(1, 2, len(POSITIONS), cfg.head_dim, generator=gen)  # [B, H, T, D], pre-RoPE

    def hf_keys(positions):
        cos, sin = model.model.rotary_emb(k0, positions[None])
        assert cos.shape[-1] in (spec.rotary_dim, cfg.head_dim)  # (GLM-4, Phi-3: the rotary span)
        return rope(k0, k0, cos, sin)[1][0].transpose(0, 1)  # [T, H, D]

    for delta in (1, 37, 500, -1):
        start = POSITIONS.clamp(min=max(0, -delta))
        moved = rerotate_keys(hf_keys(start), torch.full((len(start),), delta), spec)
        torch.testing.assert_close(moved, hf_keys(start + delta), rtol=0, atol=5e-4)
    assert spec.rotary_dim == int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))


# DeepSeek-V2/V3's attention: YaRN with mscale (`deepseek_yarn` in vLLM, `yarn` in HF), rotary
# part of 32 dims; a latent part of 64.
KV_LORA_RANK, ROPE_DIM = 64, 32
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,  # (V2/V3 set both equal, a magnitude of 1: here the keys carry 1.139)
}


def test_mla_k_pe_moves_inside_the_latent_vector_as_hf_rotates():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    cfg = DeepseekV2Config(
        hidden_size=128,
        num_attention_heads=4,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        qk_nope_head_dim=32,
        v_head_dim=32,
        head_dim=ROPE_DIM,  # HF's rotary embedding sizes itself by head_dim: the rope part
        max_position_embeddings=1024,
        rope_parameters=YARN,
    )
    hf_rope = ds.DeepseekV2RotaryEmbedding(cfg)
    spec = vllm_spec(ROPE_DIM, False, {**YARN, "rope_type": "deepseek_yarn"})
    assert spec.mscale != 1.0 and not spec.is_neox_style
    gen = torch.Generator().manual_seed(56)
    k_pe = torch.randn(1, 1, len(POSITIONS), ROPE_DIM, generator=gen)  # [B, 1, T, rope], pre-RoPE
    latent = torch.randn(len(POSITIONS), 1, KV_LORA_RANK, generator=gen)

    def hf_k_pe(positions):
        freqs = hf_rope(k_pe, positions[None])
        return ds.apply_rotary_emb(k_pe, k_pe, freqs)[1][0].transpose(0, 1)  # [T, 1, rope]

    for delta in (1, 300, -1):
        start = POSITIONS.clamp(min=max(0, -delta))
        row = torch.cat((latent, hf_k_pe(start)), dim=-1)  # the MLA cache row: one KV head
        view = row[..., KV_LORA_RANK:]
        assert rerotate_keys_(view, torch.full((len(start),), delta), spec) is view
        assert torch.equal(row[..., :KV_LORA_RANK], latent)  # the latent part is position-free
        torch.testing.assert_close(row[..., KV_LORA_RANK:], hf_k_pe(start + delta), rtol=0, atol=5e-4)
