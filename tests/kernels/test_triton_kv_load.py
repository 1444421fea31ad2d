"""The fused Triton pool → paged load against the torch reference (gather, `Rotation.apply_`,
scatter), every element checked, on poisoned caches.

On a CUDA machine the cases run on the GPU. Elsewhere one test runs this file again in a child
process under the Triton interpreter (`TRITON_INTERPRET=1`, decided when the kernel is defined,
so it cannot be switched on inside this process without touching vLLM's own kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_ascend_chunk.ops.rotary import RotarySpec, Rotation

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu" if INTERPRETED else None
on_device = pytest.mark.skipif(
    DEVICE is None, reason="no CUDA here: run by test_cases_under_the_triton_interpreter"
)


@pytest.mark.skipif(DEVICE is not None, reason="the cases run directly on this device")
def test_cases_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" in done.stdout  # the cases ran, this test skipped


def _spec(head_size: int, rotary_dim: int, neox: bool) -> RotarySpec:
    half = rotary_dim // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    return RotarySpec(head_size=head_size, rotary_dim=rotary_dim, is_neox_style=neox, inv_freq=inv_freq)


def _caches(num_blocks: int, block_size: int, heads: int, head_size: int, dtype, layout: str):
    """Poisoned (NaN) K and V views in the flash layout: NHD, or HND strides seen through NHD."""
    if layout == "NHD":
        kv = torch.full(
            (num_blocks, 2, block_size, heads, head_size), float("nan"), dtype=dtype, device=DEVICE
        )
    else:
        kv = torch.full(
            (num_blocks, 2, heads, block_size, head_size), float("nan"), dtype=dtype, device=DEVICE
        ).transpose(2, 3)
    return kv.unbind(1)


def _reference(pool_k, pool_v, rows, slots, key_cache, value_cache, rotation):
    keep = slots >= 0
    rows, slots = rows[keep], slots[keep]
    key = pool_k.index_select(0, rows)
    if rotation is not None:
        rotation = Rotation(rotation.spec, rotation.cos[keep], rotation.sin[keep])
        rotation.apply_(key)
    block_size = key_cache.shape[1]
    key_cache[slots // block_size, slots % block_size] = key
    value_cache[slots // block_size, slots % block_size] = pool_v.index_select(0, rows)


def _assert_equal_within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got.isnan(), want.isnan()), "written slots differ (or poison was overwritten)"
    g, w = got.float().nan_to_num(0.0), want.float().nan_to_num(0.0)
    # One rounding step of the cache dtype, plus the absolute error of float32 math (both sides
    # compute a*c - b*s in float32; the kernel may contract it into an FMA, which matters where
    # the two products nearly cancel).
    eps = max(torch.finfo(got.dtype).eps, 4 * torch.finfo(torch.float32).eps)
    bound = w.abs() * eps + 1e-6
    bad = (g - w).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements off, max diff {(g - w).abs().max().item():.3g}"


CASES = [
    # (dtype, heads, head_size, rotary_dim, neox, layout, rotate)
    (torch.float32, 4, 64, 64, True, "NHD", True),
    (torch.float32, 4, 64, 64, False, "NHD", True),
    (torch.bfloat16, 4, 128, 128, True, "NHD", True),
    (torch.bfloat16, 5, 128, 64, False, "HND", True),  # partial rotary, GPT-J, HND strides
    (torch.float16, 3, 80, 48, True, "HND", True),  # head_size not a power of two
    (torch.bfloat16, 40, 128, 128, True, "HND", True),  # heads split over two programs per token
    (torch.bfloat16, 4, 64, 64, True, "NHD", False),  # plain copy
    (torch.float32, 2, 32, 24, True, "NHD", True),  # Phi-4-mini: three quarters, pairs not a power of two
    (torch.float32, 2, 32, 16, False, "HND", True),  # GLM-4: half of each head, interleaved pairs
]


@on_device
@pytest.mark.parametrize("dtype,heads,head_size,rotary_dim,neox,layout,rotate", CASES)
def test_kernel_matches_the_reference(dtype, heads, head_size, rotary_dim, neox, layout, rotate):
    from vllm_ascend_chunk.ops.triton_kv_load import load_into_paged

    g = torch.Generator().manual_seed(head_size * 7 + rotary_dim + neox)
    num_tokens, num_blocks, pool_rows = (300, 40, 512) if DEVICE == "cuda" else (37, 6, 64)
    block_size = 16
    pool = torch.randn((2, pool_rows, heads, head_size), generator=g).to(DEVICE, dtype)
    rows = torch.randint(0, pool_rows, (num_tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    slots[::11] = -1  # padding tokens are skipped
    spec = _spec(head_size, rotary_dim, neox)
    deltas = torch.randint(-5, 200_000, (num_tokens,), generator=g)
    deltas[::7] = 0
    rotation = Rotation.for_deltas(deltas, spec, torch.device(DEVICE)) if rotate else None

    got_k, got_v = _caches(num_blocks, block_size, heads, head_size, dtype, layout)
    want_k, want_v = _caches(num_blocks, block_size, heads, head_size, dtype, layout)
    load_into_paged(pool[0], pool[1], rows, slots, got_k, got_v, rotation)
    _reference(pool[0], pool[1], rows, slots, want_k, want_v, rotation)

    assert torch.equal(got_v.nan_to_num(0.0), want_v.nan_to_num(0.0))
    assert torch.equal(got_v.isnan(), want_v.isnan())
    _assert_equal_within_one_rounding(got_k, want_k)
    zero = (deltas == 0).to(DEVICE) & (slots >= 0)
    if rotate and zero.any():  # a zero delta leaves the key bit-identical
        s = slots[zero]
        assert torch.equal(got_k[s // block_size, s % block_size], pool[0].index_select(0, rows[zero]))


@on_device
def test_no_rows_is_a_no_op():
    from vllm_ascend_chunk.ops.triton_kv_load import load_into_paged

    k, v = _caches(2, 16, 2, 64, torch.float32, "NHD")
    pool = torch.zeros((2, 4, 2, 64), device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    load_into_paged(pool[0], pool[1], empty, empty, k, v, None)
    assert k.isnan().all() and v.isnan().all()


@on_device
def test_mismatched_shapes_are_refused():
    from vllm_ascend_chunk.ops.triton_kv_load import load_into_paged

    k, v = _caches(2, 16, 2, 64, torch.float32, "NHD")
    pool = torch.zeros((2, 4, 2, 32), device=DEVICE)
    idx = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="do not match"):
        load_into_paged(pool[0], pool[1], idx, idx, k, v, None)
