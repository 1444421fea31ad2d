"""The pool's size: `VLLM_CHUNK_CACHE_SIZE_GB`, or, unset, a share of the engine's KV memory chosen
in the engine core and recorded for every process (real `VllmConfig`s, a stand-in executor)."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest

from tests.unit.test_engine_config import OFFLOADING, engine_config_of, multi
from vllm_ascend_chunk.config import engine as engine_config
from vllm_ascend_chunk.config.engine_settings import pool_geometry
from vllm_ascend_chunk.config.pool_size import pool_shape
from vllm_ascend_chunk.core.geometry import auto_pool_bytes

MiB, GiB = 2**20, 2**30


class Executor:
    """`determine_available_memory` and `collective_rpc` of one worker with a config of its own."""

    def __init__(self, available: int, worker_config) -> None:
        self.available = available
        self.worker = SimpleNamespace(vllm_config=worker_config)

    def determine_available_memory(self) -> list[int]:
        return [self.available]

    def collective_rpc(self, method, args=()):
        return [method(self.worker, *args)]


@pytest.fixture
def pool_env(chunk_env):
    """Sets (or, with None, unsets) VLLM_CHUNK_CACHE_SIZE_GB for the test."""
    return lambda value: chunk_env(VLLM_CHUNK_CACHE_SIZE_GB=value)


@pytest.fixture
def pool_log():
    import vllm.logger  # noqa: F401  (its logging set-up clears the handlers of "vllm.*" loggers)

    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    engine_config.logger.addHandler(handler)
    previous = engine_config.logger.level
    engine_config.logger.setLevel(logging.INFO)
    yield records
    engine_config.logger.removeHandler(handler)
    engine_config.logger.setLevel(previous)


@pytest.mark.parametrize(
    "kv, pool",
    [
        (8 * GiB, 2 * GiB),  # a quarter
        (1 * GiB, 256 * MiB),  # a quarter, at the floor
        (600 * MiB, 256 * MiB),  # the floor
        (300 * MiB, 150 * MiB),  # never more than half the KV memory
        (80 * GiB, 8 * GiB),  # the ceiling
    ],
)
def test_the_auto_pool_is_a_quarter_of_kv_memory_within_floor_and_ceiling(kv, pool):
    assert auto_pool_bytes(kv) == pool


def test_unset_the_pool_is_sized_in_the_engine_core_and_recorded_for_every_process(
    models_dir, pool_env, pool_log
):
    pool_env(None)
    core, worker, frontend = (engine_config_of(models_dir / "tiny-llama") for _ in range(3))
    with pytest.raises(RuntimeError, match="before the engine sized it"):
        pool_geometry(core)
    page_bytes = pool_shape(core).page_bytes
    left = engine_config.carve_out_pool(core, Executor(1 * GiB, worker))
    pages = 256 * MiB // page_bytes
    assert left == [1 * GiB - pages * page_bytes]
    assert pool_geometry(core).num_pages == pool_geometry(worker).num_pages == pages
    engine_config.apply_ready_response(frontend, pages)  # the ready response's value
    assert pool_geometry(frontend).num_pages == pages
    (line,) = [m for m in pool_log if m.startswith("Chunk Cache pool:")]
    tokens = pages * 16
    assert f"{tokens} tokens: {tokens // 512} documents of 512 tokens" in line
    assert "auto: 0.25 of 1.00 GiB of KV memory" in line


def test_the_chunk_cache_child_of_a_multi_connector_reads_the_recorded_size(models_dir, pool_env):
    from vllm.config import KVTransferConfig

    pool_env(None)
    core, worker = (
        engine_config_of(models_dir / "tiny-llama", kv_transfer_config=multi(OFFLOADING)) for _ in "ab"
    )
    engine_config.carve_out_pool(core, Executor(2 * GiB, worker))
    for config in (core, worker):
        # As vLLM's MultiConnector builds each child: a copy with the child's own KV config.
        child = copy.copy(config)
        child.kv_transfer_config = KVTransferConfig(
            **config.kv_transfer_config.kv_connector_extra_config["connectors"][0]
        )
        assert pool_geometry(child).num_pages == 512 * MiB // pool_shape(core).page_bytes


def test_a_set_size_is_used_as_it_is_and_refused_when_it_does_not_fit(models_dir, pool_env):
    pool_env("0.5")
    core, worker = (engine_config_of(models_dir / "tiny-llama") for _ in "ab")
    pages = int(0.5 * GiB) // pool_shape(core).page_bytes
    assert pool_geometry(core).num_pages == pages  # known before the engine starts
    assert engine_config.carve_out_pool(core, Executor(1 * GiB, worker)) == [
        GiB - pages * pool_shape(core).page_bytes
    ]
    with pytest.raises(
        engine_config.ChunkCacheSetupError, match="VLLM_CHUNK_CACHE_SIZE_GB=0.5 leaves no memory"
    ):
        engine_config.carve_out_pool(core, Executor(GiB // 4, worker))


def test_kv_memory_too_small_for_any_pool_is_a_clear_error(models_dir, pool_env):
    pool_env(None)
    core, worker = (engine_config_of(models_dir / "tiny-llama") for _ in "ab")
    with pytest.raises(engine_config.ChunkCacheSetupError, match="too little for a Chunk Cache pool"):
        engine_config.carve_out_pool(core, Executor(pool_shape(core).page_bytes, worker))


@pytest.mark.parametrize("name", ["VLLM_CHUNK_CACHE_SIZE_GB", "VLLM_CHUNK_CACHE_HOST_GB"])
def test_a_size_below_one_page_fails_the_engine_config_naming_the_variable(models_dir, chunk_env, name):
    chunk_env(**{name: "0.000001"})  # 1 KiB: not one 16-token page of tiny Llama (16 KiB)
    with pytest.raises(ValueError, match=f"{name}=1e-06 holds no page of this model's pool"):
        engine_config_of(models_dir / "tiny-llama")


def test_the_geometry_is_computed_once_per_engine(models_dir, pool_env, monkeypatch):
    """`configure` computes the row format; the engine core, the connectors, the frontend (on
    every request) and copies of the config reuse it, and the sized geometry, without recomputing."""
    pool_env("0.5")
    core = engine_config_of(models_dir / "tiny-llama")

    def never(*args):
        raise AssertionError("the pool's geometry is computed again")

    monkeypatch.setattr(type(core.model_config), "get_num_layers_by_block_type", never)
    geometry = pool_geometry(core)
    assert pool_geometry(core) is geometry and pool_geometry(copy.copy(core)) is geometry
    assert engine_config.carve_out_pool(core, Executor(GiB, core)) == [GiB - geometry.num_bytes]
