"""The NPU ops without an NPU: their layout and index logic on CPU tensors in the NPU layout (separate
K and V caches of [blocks, 128, heads, head_size], int32 slots), with the pure-torch references
standing in for the torch_npu calls; and `tools/deploy/npu_selfcheck.py` as far as it runs on a CPU."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import REPO
from tools.deploy import npu_selfcheck as selfcheck
from vllm_ascend_chunk.ops import npu
from vllm_ascend_chunk.ops.rotary import RotarySpec, apply_rotation_, rotation_tables

BLOCK_SIZE = 128


# ---------------------------------------------------------------------------------------------
# The NPU ops on CPU tensors in the NPU layout

POISON = -4242.0


def _poisoned_pair(num_blocks: int, heads: int, head_size: int, dtype: torch.dtype):
    return tuple(torch.full((num_blocks, BLOCK_SIZE, heads, head_size), POISON, dtype=dtype) for _ in "kv")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_writer_puts_each_token_in_its_block_and_offset(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, heads, head_size, tokens = 4, 2, 64, 300
    key, value = (torch.randn(tokens, heads, head_size, generator=gen).to(dtype) for _ in "kv")
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:tokens]  # int64, as the pool passes
    seen = []

    def op(**kwargs):
        seen.append(kwargs["slot_mapping"].dtype)
        npu.reshape_and_cache_reference(**kwargs)

    caches = _poisoned_pair(num_blocks, heads, head_size, dtype)
    npu.npu_kv_writer(caches, write_op=op)(key, value, slots)

    expected = _poisoned_pair(num_blocks, heads, head_size, dtype)
    for i, slot in enumerate(slots.tolist()):  # independent of the reference's vectorised indexing
        expected[0][slot // BLOCK_SIZE, slot % BLOCK_SIZE] = key[i]
        expected[1][slot // BLOCK_SIZE, slot % BLOCK_SIZE] = value[i]
    assert seen == [torch.int32]
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_reference_refuses_slots_outside_the_cache():
    caches = _poisoned_pair(2, 1, 8, torch.float32)
    kv = torch.zeros(1, 1, 8)
    for slot in (-1, 2 * BLOCK_SIZE):
        with pytest.raises(IndexError):
            npu.reshape_and_cache_reference(kv, kv, *caches, torch.tensor([slot], dtype=torch.int32))


def test_writer_refuses_layouts_other_than_the_nd_pair():
    layer = SimpleNamespace(num_kv_heads=2, head_size=64, layer_name="model.layers.0.self_attn.attn")
    with pytest.raises(NotImplementedError, match="ND paged KV cache"):
        npu.npu_kv_writer(torch.zeros(3, 2, BLOCK_SIZE, 2, 64), layer, npu.reshape_and_cache_reference)
    with pytest.raises(NotImplementedError, match="ND paged KV cache"):
        npu.npu_kv_writer(
            (torch.zeros(3, BLOCK_SIZE, 2, 64), torch.zeros(3, BLOCK_SIZE, 2, 32)),
            layer,
            npu.reshape_and_cache_reference,
        )
    nz_like = tuple(torch.zeros(3, 2 * 64 // 16, BLOCK_SIZE, 16) for _ in "kv")  # Atlas 300I's layout
    with pytest.raises(NotImplementedError, match="unsupported NPU layout"):
        npu.npu_kv_writer(nz_like, layer, npu.reshape_and_cache_reference)


def test_make_kv_writer_takes_the_npu_branch_on_ascend(monkeypatch):
    import vllm.platforms

    from vllm_ascend_chunk.ops.dispatch import make_kv_writer

    ascend = SimpleNamespace(
        is_cpu=lambda: False, is_cuda_alike=lambda: False, device_type="npu", device_name="npu"
    )
    monkeypatch.setattr(vllm.platforms, "current_platform", ascend, raising=False)
    monkeypatch.setattr(npu, "device_reshape_and_cache", lambda: npu.reshape_and_cache_reference)
    caches = _poisoned_pair(2, 1, 8, torch.float32)
    layer = SimpleNamespace(num_kv_heads=1, head_size=8, layer_name="l0")
    make_kv_writer(caches, layer, None)(torch.ones(1, 1, 8), 2 * torch.ones(1, 1, 8), torch.tensor([130]))
    assert (caches[0][1, 2] == 1).all() and (caches[1][1, 2] == 2).all()
    assert int((caches[0] == POISON).sum()) == caches[0].numel() - 8


def test_rotary_mul_reference_follows_the_documented_formula():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    zero, one = torch.zeros(4), torch.ones(4)
    assert npu.rotary_mul_reference(x, zero, one, "half").tolist() == [-3.0, -4.0, 1.0, 2.0]
    assert npu.rotary_mul_reference(x, zero, one, "interleave").tolist() == [-2.0, 1.0, -4.0, 3.0]
    assert npu.rotary_mul_reference(x, one, zero).tolist() == x.tolist()
    with pytest.raises(ValueError):
        npu.rotary_mul_reference(x, one, zero, "other")


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [128, 64, 96])  # 96: three quarters (Phi-4-mini)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_fused_rotation_matches_the_torch_reference(neox: bool, rotary_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(rotary_dim + neox)
    inv_freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    spec = RotarySpec(head_size=128, rotary_dim=rotary_dim, is_neox_style=neox, inv_freq=inv_freq)
    keys = torch.randn(40, 4, 128, generator=gen).to(dtype)
    deltas = torch.randint(-5000, 5000, (40,), generator=gen)
    cos, sin = rotation_tables(deltas, spec, torch.device("cpu"))
    want = apply_rotation_(keys.clone(), cos, sin, spec)
    got = keys.clone()
    assert npu.npu_apply_rotation_(got, cos, sin, spec, rotary_mul=npu.rotary_mul_reference) is got
    assert torch.equal(got, want)  # same float32 products and sums, one rounding: bit-identical


def test_fused_rotation_refuses_bad_shapes():
    spec = RotarySpec(head_size=8, rotary_dim=8, is_neox_style=True, inv_freq=torch.ones(4))
    cos = torch.ones(3, 4)
    for keys, c in ((torch.zeros(3, 8), cos), (torch.zeros(3, 1, 16), cos), (torch.zeros(3, 1, 8), cos[:2])):
        with pytest.raises(ValueError):
            npu.npu_apply_rotation_(keys, c, c, spec, rotary_mul=npu.rotary_mul_reference)


# ---------------------------------------------------------------------------------------------
# tools/deploy/npu_selfcheck.py without an NPU


def test_selfcheck_help_needs_no_torch_npu():
    assert importlib.util.find_spec("torch_npu") is None
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "deploy" / "npu_selfcheck.py"), "--help"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "--skip-generation" in result.stdout


def test_selfcheck_op_checks_pass_on_cpu():
    out = io.StringIO()
    with redirect_stdout(out):
        assert selfcheck.main(["--device", "cpu", "--skip-generation"]) == 0
    lines = out.getvalue().splitlines()
    assert sum(line.startswith("PASS  kv writer") for line in lines) == 6
    assert sum(line.startswith("PASS  rotation (fused op)") for line in lines) == 18
    assert sum(line.startswith("PASS  MLA k_pe rotation") for line in lines) == 6
    assert not any(line.startswith("FAIL") for line in lines)


def test_selfcheck_catches_faulty_ops():
    def shifted_writer(pair):  # every token one slot too far
        write = npu.npu_kv_writer(pair, write_op=npu.reshape_and_cache_reference)
        return lambda k, v, slots: write(k, v, (slots + 1) % (pair[0].shape[0] * BLOCK_SIZE))

    ok, detail = selfcheck.check_kv_writer(shifted_writer, "cpu", torch.bfloat16, 2, 64, seed=0)
    assert not ok and detail.split()[0] != "0"

    def wrong_sign(keys, cos, sin, spec):
        return apply_rotation_(keys, cos, -sin, spec)

    def touches_the_tail(keys, cos, sin, spec):
        keys[..., spec.rotary_dim :] += 1
        return apply_rotation_(keys, cos, sin, spec)

    for rotate in (wrong_sign, touches_the_tail):
        assert not selfcheck.check_rotation(rotate, "cpu", torch.float32, True, 64, seed=0)[0]

    def on_a_copy(keys, cos, sin, spec):  # an op that rotates a copy: the latent row never changes
        return apply_rotation_(keys.clone(), cos, sin, spec)

    for rotate in (wrong_sign, on_a_copy):
        assert not selfcheck.check_latent_rotation(rotate, "cpu", torch.float32, seed=0)[0]

    def raises():
        raise RuntimeError("op refused its input")

    (result,) = selfcheck.run_checks(iter([("refusing op", raises)]))
    assert not result.ok and "op refused its input" in result.detail


def test_selfcheck_lets_sequences_part_only_at_a_near_tie():
    ref = {"tokens": [1, 2, 3], "gaps": [2.0, 0.01, 2.0]}
    assert selfcheck.agreement("x", ref, {"tokens": [1, 2, 3]}, 0.05).ok
    assert selfcheck.agreement("x", ref, {"tokens": [1, 9, 9]}, 0.05).ok
    assert not selfcheck.agreement("x", ref, {"tokens": [7, 2, 3]}, 0.05).ok
    assert not selfcheck.agreement("x", ref, {"tokens": [1, 2]}, 0.05).ok
