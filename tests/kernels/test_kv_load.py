"""The CPU pool → paged-cache loader: gathered in staging pieces shared by every layer, written
by the CPU_ATTN op, read back through the learned layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ascend_chunk.ops import base
from vllm_ascend_chunk.ops.base import Staging
from vllm_ascend_chunk.ops.cpu import cpu_reader
from vllm_ascend_chunk.ops.dispatch import make_kv_loader
from vllm_ascend_chunk.ops.rotary import RotarySpec, Rotation, rerotate_keys

HEADS, HEAD, BLOCK, BLOCKS, POOL_ROWS = 2, 32, 16, 8, 200


@pytest.mark.parametrize("rotate", [False, True], ids=["overlap", "sequential"])
def test_loads_longer_than_a_staging_piece_land_in_every_layer(monkeypatch, rotate):
    monkeypatch.setattr(base, "STAGING_ROWS", 8)  # 37 rows: four full pieces and a partial one
    torch.manual_seed(0)
    config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"))
    caches = [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD) for _ in range(2)]
    staging = Staging()
    loaders = [make_kv_loader(cache, None, config, staging) for cache in caches]
    pools = [(torch.randn(POOL_ROWS, HEADS, HEAD), torch.randn(POOL_ROWS, HEADS, HEAD)) for _ in caches]
    rows = torch.randperm(POOL_ROWS)[:37]
    slots = torch.randperm(BLOCKS * BLOCK)[:37]
    spec = RotarySpec(head_size=HEAD, rotary_dim=HEAD, is_neox_style=True, inv_freq=torch.rand(HEAD // 2))
    deltas = torch.randint(-50, 50, (37,))
    rotation = Rotation.for_deltas(deltas, spec, torch.device("cpu")) if rotate else None

    for load, (pool_k, pool_v) in zip(loaders, pools, strict=True):
        load(pool_k, pool_v, rows, slots, rotation)

    for cache, (pool_k, pool_v) in zip(caches, pools, strict=True):
        key, value = cpu_reader(cache, "auto")(slots)
        expected_key = rerotate_keys(pool_k[rows], deltas, spec) if rotate else pool_k[rows]
        torch.testing.assert_close(key, expected_key, rtol=0, atol=1e-6)
        assert torch.equal(value, pool_v[rows])
