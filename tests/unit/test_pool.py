"""ChunkCachePool without an engine: small CPU_ATTN paged caches written and read through the
backend's own op (the loaders and readers a CPU worker builds), a pool and a host tier
(`HostCopies`) on them.

Saves copy paged-cache slots into pool rows for every layer, loads copy them back (keys moved by
a rotation when given), rows move between the pool, host copies and the host tier; every move
touches exactly the rows it names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

from vllm_ascend_chunk.core.geometry import PoolGeometry
from vllm_ascend_chunk.core.pool import ChunkCachePool
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata
from vllm_ascend_chunk.ops.base import KVLoader, KVReader, Staging
from vllm_ascend_chunk.ops.cpu import cpu_reader, cpu_writer
from vllm_ascend_chunk.ops.dispatch import make_kv_loader
from vllm_ascend_chunk.ops.rotary import RotarySpec, Rotation, rerotate_keys
from vllm_ascend_chunk.tiers.host.scheduler import HostJobs
from vllm_ascend_chunk.tiers.host.worker import HostCopies

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 2, 2, 32, 16, 6
CPU = torch.device("cpu")


def geometry(dtype: torch.dtype = torch.float32, host_pages: int = 3) -> PoolGeometry:
    return PoolGeometry(
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype=dtype,
        num_pages=4,
        page_size=16,
        num_host_pages=host_pages,
    )


@dataclass
class Paged:
    """One paged CPU_ATTN cache per layer, and the pool built on them."""

    caches: list[torch.Tensor]
    loaders: list[KVLoader]
    readers: list[KVReader]
    pool: ChunkCachePool

    def write(self, slots: torch.Tensor, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Random K/V (different in every layer) written at `slots` by the backend's op."""
        gen = torch.Generator().manual_seed(seed)
        written = []
        for cache in self.caches:
            key, value = (torch.randn(len(slots), HEADS, HEAD, generator=gen).to(cache.dtype) for _ in "kv")
            cpu_writer(cache, "auto")(key, value, slots)
            written.append((key, value))
        return written

    def read(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [read(slots) for read in self.readers]


def paged(geo: PoolGeometry) -> Paged:
    config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"))
    caches = [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=geo.dtype) for _ in range(geo.num_layers)]
    staging = Staging()
    loaders = [make_kv_loader(cache, None, config, staging) for cache in caches]
    readers = [cpu_reader(cache, "auto") for cache in caches]
    return Paged(caches, loaders, readers, ChunkCachePool(geo, loaders, readers, CPU))


def rows(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def random_rows(pool: ChunkCachePool, count: int, seed: int) -> torch.Tensor:
    """Values shaped as `read_rows` returns for `count` rows."""
    g = pool.geometry
    shape = (g.num_layers, 2, count, g.num_kv_heads, g.head_size)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(g.dtype)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def test_the_pool_refuses_a_model_with_another_number_of_layers() -> None:
    p = paged(geometry())
    with pytest.raises(RuntimeError, match=f"sized for {LAYERS} attention layers, the model has 1"):
        ChunkCachePool(geometry(), p.loaders[:1], p.readers[:1], CPU)


@DTYPES
def test_pool_and_host_tier_tensors(dtype: torch.dtype) -> None:
    pool = paged(geometry(dtype)).pool
    assert pool.kv.shape == (LAYERS, 2, 64, HEADS, HEAD) and pool.kv.dtype == dtype
    assert not pool.kv.any()
    host = HostCopies(geometry(dtype), CPU).kv
    assert host.shape == (LAYERS, 2, 48, HEADS, HEAD) and host.dtype == dtype
    assert not host.any() and not host.is_pinned()  # pinned only beside an accelerator


@DTYPES
@pytest.mark.parametrize("rotate", [False, True], ids=["overlap", "sequential"])
def test_saved_rows_load_back_into_other_slots_in_every_layer(dtype: torch.dtype, rotate: bool) -> None:
    p = paged(geometry(dtype))
    computed = rows(3, 17, 18, 40, 95, 2, 33)
    pool_rows = rows(63, 0, 16, 15, 31, 32, 7)  # first and last rows, page edges, any order
    written = p.write(computed, seed=1)
    p.pool.save(pool_rows, computed)
    others = torch.ones(p.pool.geometry.num_rows, dtype=torch.bool)
    others[pool_rows] = False
    assert not p.pool.kv[:, :, others].any(), "a save wrote rows it was not given"
    for cache in p.caches:
        cache.zero_()
    targets = rows(50, 1, 64, 65, 80, 10, 11)
    rotation = deltas = spec = None
    if rotate:
        gen = torch.Generator().manual_seed(2)
        spec = RotarySpec(head_size=HEAD, rotary_dim=HEAD, is_neox_style=True, inv_freq=torch.rand(HEAD // 2))
        deltas = torch.randint(-40, 40, (len(targets),), generator=gen)
        rotation = Rotation.for_deltas(deltas, spec, CPU)
    p.pool.load(pool_rows, targets, rotation)
    tol = {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for (key, value), (got_key, got_value) in zip(written, p.read(targets), strict=True):
        expected_key = rerotate_keys(key, deltas, spec) if rotate else key
        torch.testing.assert_close(got_key, expected_key, **tol)
        assert torch.equal(got_value, value)
    untouched = torch.tensor([s for s in range(BLOCKS * BLOCK) if s not in targets.tolist()])
    assert all(not k.any() and not v.any() for k, v in p.read(untouched)), "a load wrote other slots"


@DTYPES
def test_read_rows_is_a_host_copy_in_the_order_asked(dtype: torch.dtype) -> None:
    pool = paged(geometry(dtype)).pool
    values = random_rows(pool, 3, seed=3)
    pool.write_rows([5, 63, 16], values)
    got = pool.read_rows([16, 5, 63, 5])
    assert got.device.type == "cpu" and got.shape == (LAYERS, 2, 4, HEADS, HEAD) and got.dtype == dtype
    assert torch.equal(got, values[:, :, [2, 0, 1, 0]])
    got.zero_()
    assert torch.equal(pool.read_rows([5, 63, 16]), values), "read_rows returned a view of the pool"


def test_write_rows_touches_only_its_rows() -> None:
    pool = paged(geometry()).pool
    pool.write_rows(list(range(64)), random_rows(pool, 64, seed=4))
    before = pool.kv.clone()
    values = random_rows(pool, 2, seed=5)
    pool.write_rows([9, 40], values)
    assert torch.equal(pool.read_rows([9, 40]), values)
    keep = [r for r in range(64) if r not in (9, 40)]
    assert torch.equal(pool.kv[:, :, keep], before[:, :, keep])


@DTYPES
def test_rows_go_to_the_host_tier_and_come_back_elsewhere(dtype: torch.dtype) -> None:
    pool = paged(geometry(dtype)).pool
    host = HostCopies(geometry(dtype), CPU)
    values = random_rows(pool, 3, seed=6)
    pool.write_rows([0, 17, 63], values)
    host.to_host(pool, [0, 17, 63], [47, 0, 20])
    host_others = [r for r in range(48) if r not in (47, 0, 20)]
    assert not host.kv[:, :, host_others].any(), "to_host wrote host rows it was not given"
    assert torch.equal(host.kv[:, :, [47, 0, 20]], values)
    pool.kv.zero_()  # the pool rows are reused meanwhile
    host.from_host(pool, [20, 47], [33, 34])
    assert torch.equal(pool.read_rows([33, 34]), values[:, :, [2, 0]])
    pool_others = [r for r in range(64) if r not in (33, 34)]
    assert not pool.kv[:, :, pool_others].any(), "from_host wrote pool rows it was not given"
    assert torch.equal(host.kv[:, :, [47, 0, 20]], values), "from_host changed the host tier"


def test_a_step_copies_into_the_host_tier_before_it_copies_out_of_it() -> None:
    """A pool row freed and reused in the same step: its old content reaches the host first."""
    pool = paged(geometry()).pool
    host = HostCopies(geometry(), CPU)
    old, kept = random_rows(pool, 2, seed=10), random_rows(pool, 2, seed=11)
    pool.write_rows([5, 6], old)
    host.kv[:, :, [30, 31]] = kept
    jobs = HostJobs(write_from=[5, 6], write_to=[0, 1], read_from=[30, 31], read_to=[5, 6])
    host.start(ChunkCacheStepMetadata(tier_jobs={host.name: jobs}), pool)
    assert torch.equal(host.kv[:, :, [0, 1]], old) and torch.equal(pool.read_rows([5, 6]), kept)


def test_empty_moves_change_nothing() -> None:
    p = paged(geometry())
    p.write(rows(*range(BLOCKS * BLOCK)), seed=7)
    p.pool.write_rows(list(range(64)), random_rows(p.pool, 64, seed=8))
    host = HostCopies(geometry(), CPU)
    host.to_host(p.pool, list(range(48)), list(range(48)))
    state = [t.clone() for t in (p.pool.kv, host.kv, *p.caches)]
    empty = rows()
    p.pool.save(empty, empty)
    p.pool.load(empty, empty)
    p.pool.write_rows([], random_rows(p.pool, 0, seed=9))
    host.start(ChunkCacheStepMetadata(), p.pool)
    assert p.pool.read_rows([]).shape == (LAYERS, 2, 0, HEADS, HEAD)
    assert all(torch.equal(a, b) for a, b in zip(state, (p.pool.kv, host.kv, *p.caches), strict=True))


def test_a_pool_of_another_geometry_is_sized_by_it() -> None:
    """Rows are pages times page size; the host tier has the pool's row format."""
    geo = replace(geometry(), num_pages=2, page_size=8, num_host_pages=5)
    p = paged(geometry())
    pool = ChunkCachePool(geo, p.loaders, p.readers, CPU)
    assert pool.kv.shape[2] == geo.num_rows == 16
    assert HostCopies(geo, CPU).kv.shape == (LAYERS, 2, 40, HEADS, HEAD)
    assert pool.kv.numel() * pool.kv.element_size() == geo.num_bytes
