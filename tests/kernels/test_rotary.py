"""Rotary correction (`vllm_ascend_chunk.ops.rotary`) against vLLM's own rotary embeddings.

vLLM builds its cos/sin cache in float32 (`fl(t * inv_freq)`), so at an arbitrary position its
angle is off by up to half a float32 ulp of the angle (~1e-4 rad at t ~ 4000): its keys are
accurate to ~5e-4 there. At power-of-two positions the float32 product is exact and vLLM's keys
are exact to float32 rounding; the 1e-5 comparisons use those. Large deltas are checked against
an exact float64 RoPE. bf16: a bf16-exact key moved by delta is within one bf16 step of vLLM's
float32 key rounded to bf16 (a single rounding); a key that was itself rounded to bf16 at p is
within two steps at its pair's magnitude.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ascend_chunk.ops.rotary import (
    RotarySpec,
    UnsupportedRopeError,
    rerotate_keys,
    rerotate_keys_,
    rotary_spec_from_vllm,
)

MAX_POSITION = 8192
VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
    },
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0, "max_trained_positions": 4096},
    "dynamic_alpha": {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 2.0},
    "ntk": {"rope_type": "ntk", "rope_theta": 10000.0, "factor": 2.0},
    "deepseek_yarn": {
        "rope_type": "deepseek_yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.0,
    },
    "telechat3_yarn": {
        "rope_type": "telechat3-yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
    },
    "gemma4_proportional": {"rope_type": "proportional", "rope_theta": 10000.0},
}
EXACT_POSITIONS = [0] + [1 << k for k in range(13)]  # vLLM's float32 angles are exact here
PROPERTY = settings(max_examples=6, deadline=None, derandomize=True)  # x 40 parametrized cases


@functools.cache
def _vllm_config():
    from vllm.config import VllmConfig

    return VllmConfig()


def _construct(factory):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(_vllm_config()):
        return factory()


@functools.cache
def vllm_rope(variant: str, neox: bool, partial: float, head_size: int = 64):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = dict(VARIANTS[variant])
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    return _construct(lambda: get_rope(head_size, MAX_POSITION, neox, params, dtype=torch.float32))


def vllm_keys(rope, k0: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """vLLM's RoPE (its torch-native path, float32) applied to pre-RoPE keys k0 [T, H, D]."""
    _, key = rope.forward_native(positions, k0.clone(), k0.clone())
    return key.view(k0.shape)


def exact_keys(k0: torch.Tensor, positions: torch.Tensor, spec: RotarySpec) -> torch.Tensor:
    """RoPE in complex128: each pair as a complex number times mscale * e^(i * position * inv_freq)."""
    half = spec.rotary_dim // 2
    k = k0.double().clone()
    rot = k[..., : spec.rotary_dim]
    re, im = (rot[..., :half], rot[..., half:]) if spec.is_neox_style else (rot[..., 0::2], rot[..., 1::2])
    angles = positions.double()[:, None] * spec.inv_freq.double()[None, :]
    z = torch.complex(re, im) * torch.polar(torch.full_like(angles, spec.mscale), angles)[:, None, :]
    re.copy_(z.real)
    im.copy_(z.imag)
    return k


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bfloat16 step at |x| (8 significant bits)."""
    _, exponent = torch.frexp(x.float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def random_keys(seed: int, tokens: int, heads: int, head_size: int = 64) -> torch.Tensor:
    return torch.randn(tokens, heads, head_size, generator=torch.Generator().manual_seed(seed))


seeds = st.integers(0, 2**31 - 1)
every_rope = pytest.mark.parametrize(
    "variant, neox, partial",
    [
        pytest.param(v, n, p, id=f"{v}-{'neox' if n else 'gptj'}-{'full' if p == 1.0 else 'half'}")
        for v in VARIANTS
        for n in (True, False)
        for p in (1.0, 0.5)
    ],
)


@every_rope
@PROPERTY
@given(seed=seeds, tokens=st.integers(1, 48), heads=st.integers(1, 4), head_size=st.sampled_from([64, 128]))
def test_fp32_matches_vllm_at_exact_positions(variant, neox, partial, seed, tokens, heads, head_size):
    rope = vllm_rope(variant, neox, partial, head_size)
    spec = rotary_spec_from_vllm(rope)
    gen = torch.Generator().manual_seed(seed)
    src = torch.tensor(EXACT_POSITIONS)[torch.randint(len(EXACT_POSITIONS), (tokens,), generator=gen)]
    dst = torch.tensor(EXACT_POSITIONS)[torch.randint(len(EXACT_POSITIONS), (tokens,), generator=gen)]
    k0 = random_keys(seed, tokens, heads, head_size)
    moved = rerotate_keys(vllm_keys(rope, k0, src), dst - src, spec)  # deltas <0, 0 and >0
    torch.testing.assert_close(moved, vllm_keys(rope, k0, dst), atol=1e-5, rtol=1e-5)


@every_rope
@PROPERTY
@given(seed=seeds, tokens=st.integers(1, 48))
def test_fp32_matches_vllm_at_any_position(variant, neox, partial, seed, tokens):
    """Within vLLM's own float32 angle rounding at the two positions (see module docstring)."""
    rope = vllm_rope(variant, neox, partial)
    spec = rotary_spec_from_vllm(rope)
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(4096, (tokens,), generator=gen)
    dst = torch.randint(4096, (tokens,), generator=gen)
    k0 = random_keys(seed, tokens, 2)
    at_src = vllm_keys(rope, k0, src)
    moved = rerotate_keys(at_src, dst - src, spec)
    # vLLM's angle at t is off by <= 2^-23 * t * inv_freq (float32 t * inv_freq [and t / factor]);
    # an angle error moves an element by at most its pair's norm (<= sqrt(2) * max |element|).
    angle_err = 2.0**-23 * (src + dst).double() * spec.inv_freq.max().item()
    bound = 1e-5 + 2 * angle_err[:, None, None] * at_src.abs().amax(dim=(1, 2), keepdim=True).double()
    assert ((moved - vllm_keys(rope, k0, dst)).abs().double() <= bound).all()


@every_rope
@PROPERTY
@given(seed=seeds, tokens=st.integers(1, 48))
def test_fp32_large_deltas_match_exact_rope(variant, neox, partial, seed, tokens):
    spec = rotary_spec_from_vllm(vllm_rope(variant, neox, partial))
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(100_000, (tokens,), generator=gen)
    deltas = torch.randint(-100_000, 100_001, (tokens,), generator=gen)
    k0 = random_keys(seed, tokens, 2)
    moved = rerotate_keys(exact_keys(k0, src, spec).float(), deltas, spec)
    torch.testing.assert_close(moved.double(), exact_keys(k0, src + deltas, spec), atol=1e-5, rtol=1e-5)


@every_rope
@PROPERTY
@given(seed=seeds, tokens=st.integers(1, 48))
def test_bf16_within_one_ulp_of_vllm_fp32_rounded(variant, neox, partial, seed, tokens):
    """A bf16 key cached at position 0 (where vLLM's RoPE is mscale * identity), moved by delta,
    is within one bf16 step of vLLM's float32 key at delta rounded to bf16: a single rounding."""
    rope = vllm_rope(variant, neox, partial)
    spec = rotary_spec_from_vllm(rope)
    gen = torch.Generator().manual_seed(seed)
    deltas = torch.tensor(EXACT_POSITIONS)[torch.randint(len(EXACT_POSITIONS), (tokens,), generator=gen)]
    cached = random_keys(seed, tokens, 2).bfloat16()  # exactly mscale * k0 at position 0
    moved = rerotate_keys(cached, deltas, spec)
    assert moved.dtype == torch.bfloat16
    k0 = cached.float()
    k0[..., : spec.rotary_dim] /= spec.mscale  # only the rotated dims carry mscale
    expected = vllm_keys(rope, k0, deltas).bfloat16()
    diff = (moved.float() - expected.float()).abs()
    assert (diff <= bf16_ulp(torch.maximum(moved.float().abs(), expected.float().abs()))).all()


def pair_magnitude(x: torch.Tensor, spec: RotarySpec) -> torch.Tensor:
    """|x| per element, where a rotated element counts as the norm of its (x1, x2) pair."""
    half, out = spec.rotary_dim // 2, x.float().abs()
    if spec.is_neox_style:
        norm = torch.hypot(x[..., :half].float(), x[..., half : spec.rotary_dim].float())
        out[..., : spec.rotary_dim] = torch.cat((norm, norm), dim=-1)
    else:
        norm = torch.hypot(x[..., 0 : spec.rotary_dim : 2].float(), x[..., 1 : spec.rotary_dim : 2].float())
        out[..., : spec.rotary_dim] = norm.repeat_interleave(2, dim=-1)
    return out


@every_rope
@PROPERTY
@given(seed=seeds, tokens=st.integers(1, 48))
def test_bf16_cached_key_moves_within_two_steps(variant, neox, partial, seed, tokens):
    """A bf16 cache entry (vLLM's float32 key at p, rounded) moved by any delta, against vLLM's
    float32 key at p + delta rounded: the input's own rounding (<= half a step per element)
    rotates into its pair partner, so the bound is 0.5 + 0.5 + 0.71 steps at the pair magnitude."""
    rope = vllm_rope(variant, neox, partial)
    spec = rotary_spec_from_vllm(rope)
    gen = torch.Generator().manual_seed(seed)
    src = torch.tensor(EXACT_POSITIONS)[torch.randint(len(EXACT_POSITIONS), (tokens,), generator=gen)]
    dst = torch.tensor(EXACT_POSITIONS)[torch.randint(len(EXACT_POSITIONS), (tokens,), generator=gen)]
    k0 = random_keys(seed, tokens, 2)
    moved = rerotate_keys(vllm_keys(rope, k0, src).bfloat16(), dst - src, spec).float()
    expected = vllm_keys(rope, k0, dst).bfloat16().float()
    step = bf16_ulp(torch.maximum(pair_magnitude(expected, spec), moved.abs()))
    assert ((moved - expected).abs() <= 2 * step).all()


@every_rope
@PROPERTY
@given(seed=seeds, tokens=st.integers(1, 48))
def test_bf16_is_fp32_math_rounded_once(variant, neox, partial, seed, tokens):
    spec = rotary_spec_from_vllm(vllm_rope(variant, neox, partial))
    gen = torch.Generator().manual_seed(seed)
    deltas = torch.randint(-100_000, 100_001, (tokens,), generator=gen)
    keys = random_keys(seed, tokens, 3).bfloat16()
    in_fp32 = rerotate_keys(keys.float(), deltas, spec)
    assert torch.equal(rerotate_keys(keys, deltas, spec), in_fp32.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("neox", [True, False])
def test_zero_delta_pass_through_and_in_place(dtype, neox):
    spec = rotary_spec_from_vllm(vllm_rope("llama3", neox, 0.5))
    keys = random_keys(0, 16, 2).to(dtype)
    deltas = torch.tensor([0, 5, -7, 0] * 4)
    moved = rerotate_keys(keys, deltas, spec)
    assert moved.dtype == dtype and moved.data_ptr() != keys.data_ptr()
    assert torch.equal(moved[deltas == 0], keys[deltas == 0])
    assert torch.equal(moved[..., spec.rotary_dim :], keys[..., spec.rotary_dim :])
    assert not torch.equal(moved[deltas != 0], keys[deltas != 0])
    in_place = keys.clone()
    assert rerotate_keys_(in_place, deltas, spec) is in_place
    assert torch.equal(in_place, moved)
    torch.testing.assert_close(
        rerotate_keys(moved.float(), -deltas, spec),
        keys.float(),
        atol=1e-5 if dtype.itemsize >= 4 else 2e-2,
        rtol=1e-2,
    )


def test_spec_values():
    from vllm.model_executor.layers.rotary_embedding.common import yarn_get_mscale

    yarn = rotary_spec_from_vllm(vllm_rope("yarn", True, 1.0))
    assert yarn.mscale == pytest.approx(yarn_get_mscale(4.0)) and yarn.mscale > 1
    default = rotary_spec_from_vllm(vllm_rope("default", False, 0.5))
    assert (default.head_size, default.rotary_dim, default.is_neox_style) == (64, 32, False)
    torch.testing.assert_close(default.inv_freq, 10000.0 ** -(torch.arange(0, 32, 2).double() / 32))
    linear = rotary_spec_from_vllm(vllm_rope("linear", True, 1.0))
    plain = rotary_spec_from_vllm(vllm_rope("default", True, 1.0))
    torch.testing.assert_close(linear.inv_freq * 2, plain.inv_freq)
    with pytest.raises(ValueError, match="inv_freq"):
        RotarySpec(head_size=64, rotary_dim=32, is_neox_style=True, inv_freq=torch.ones(8))
    with pytest.raises(ValueError, match="deltas"):
        rerotate_keys(torch.zeros(2, 1, 64), torch.zeros(2), default)


def _refused_classes():
    from vllm.model_executor.layers import rotary_embedding as re
    from vllm.model_executor.layers.rotary_embedding.ernie45_vl_rope import Ernie4_5_VLRotaryEmbedding

    return [
        re.MRotaryEmbedding,
        re.MRotaryEmbeddingInterleaved,
        Ernie4_5_VLRotaryEmbedding,
        re.XDRotaryEmbedding,
        re.DualChunkRotaryEmbedding,
        re.Phi3LongRoPEScaledRotaryEmbedding,
        re.FourierRotaryEmbedding,
        re.Llama4VisionRotaryEmbedding,
        re.DeepseekV4ScalingRotaryEmbedding,
    ]


def _assert_refused(rotary_emb, class_name: str) -> None:
    with pytest.raises(UnsupportedRopeError) as info:
        rotary_spec_from_vllm(rotary_emb)
    message = str(info.value)
    assert class_name in message and "VLLM_CHUNK_CACHE_LAYOUT=sequential" in message
    assert "linear in the position" in message and "overlap" in message
    assert isinstance(info.value, ValueError)


def test_mrope_is_refused():
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
    mrope = _construct(lambda: get_rope(64, 4096, True, params, dtype=torch.float32))
    _assert_refused(mrope, "MRotaryEmbedding")


def test_non_linear_classes_are_refused_by_class():
    for cls in _refused_classes():
        _assert_refused(cls.__new__(cls), cls.__name__)  # refused by class; never built


def test_unknown_and_oot_classes(monkeypatch):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    class ModelOwnRope(RotaryEmbedding):  # an unregistered subclass: unknown math
        pass

    class PlatformRope(RotaryEmbedding):  # a platform's out-of-tree replacement (vllm-ascend style)
        pass

    class DriftedPlatformRope(RotaryEmbedding):  # replacement whose cache no longer matches
        def _compute_cos_sin_cache(self) -> torch.Tensor:
            return super()._compute_cos_sin_cache().roll(1, dims=0)

    args = (64, 64, 4096, 10000.0, True, torch.float32)
    _assert_refused(_construct(lambda: ModelOwnRope(*args)), "ModelOwnRope")
    _assert_refused(torch.nn.Identity(), "Identity")
    plain = rotary_spec_from_vllm(_construct(lambda: RotaryEmbedding(*args)))

    monkeypatch.setitem(op_registry_oot, "RotaryEmbedding", PlatformRope)
    replaced = _construct(lambda: RotaryEmbedding(*args))
    assert type(replaced) is PlatformRope
    assert torch.equal(rotary_spec_from_vllm(replaced).inv_freq, plain.inv_freq)

    monkeypatch.setitem(op_registry_oot, "RotaryEmbedding", DriftedPlatformRope)
    with pytest.raises(UnsupportedRopeError, match="differs from the derived angles"):
        rotary_spec_from_vllm(_construct(lambda: RotaryEmbedding(*args)))


def test_cache_check_tolerates_bf16_cache():
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = dict(VARIANTS["yarn"])
    rope = _construct(lambda: get_rope(64, MAX_POSITION, True, params, dtype=torch.bfloat16))
    assert rope.cos_sin_cache.dtype == torch.bfloat16
    spec = rotary_spec_from_vllm(rope)
    assert math.isclose(spec.mscale, rotary_spec_from_vllm(vllm_rope("yarn", True, 1.0)).mscale)


def test_the_sequential_layout_refuses_a_model_without_a_vllm_rope(chunk_env):
    """A model whose RoPE lives in modules vLLM does not own (its Transformers backend) would get
    keys loaded without re-rotation: refused when the worker binds the model (start-up)."""
    from types import SimpleNamespace

    from vllm_ascend_chunk.config.settings import ChunkCacheConfig
    from vllm_ascend_chunk.worker.chunk_worker import ChunkCacheWorker

    def worker(layout: str) -> SimpleNamespace:
        """A worker whose engine's settings have `layout`."""
        return SimpleNamespace(settings=ChunkCacheConfig(layout=layout))

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    chunk_env(VLLM_CHUNK_CACHE_LAYOUT="sequential")
    with pytest.raises(UnsupportedRopeError, match="no vLLM RoPE module") as info:
        ChunkCacheWorker.bind_model(worker("sequential"), model)
    assert "VLLM_CHUNK_CACHE_LAYOUT=overlap works with any model" in str(info.value)
    ChunkCacheWorker.bind_model(worker("overlap"), model)  # the engine's layout: nothing to rotate
    chunk_env(VLLM_CHUNK_CACHE_LAYOUT="overlap")  # the process's environment is not the engine's
    with pytest.raises(UnsupportedRopeError, match="no vLLM RoPE module"):
        ChunkCacheWorker.bind_model(worker("sequential"), model)
