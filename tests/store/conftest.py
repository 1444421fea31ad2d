"""Fixtures: real Mooncake processes on loopback and `RemoteStore` clients, all ended at teardown."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.mooncake_store import MooncakeProcs
from vllm_ascend_chunk.config.settings import RemoteConfig
from vllm_ascend_chunk.tiers.mooncake.objects import MOONCAKE_TCP_BOUNDS
from vllm_ascend_chunk.tiers.mooncake.store import RemoteStore


def _procs(log_dir: Path) -> Iterator[MooncakeProcs]:
    procs = MooncakeProcs(log_dir)
    try:
        yield procs.start()
    finally:
        procs.stop()


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeProcs]:
    """A master and a store process shared by a module's tests that leave them running."""
    yield from _procs(tmp_path_factory.mktemp("mooncake"))


@pytest.fixture
def own_mooncake(tmp_path: Path) -> Iterator[MooncakeProcs]:
    """A master and a store process for one test, which may kill, pause or restart them."""
    yield from _procs(tmp_path)


@pytest.fixture
def remote_store() -> Iterator[Callable[[RemoteConfig], RemoteStore]]:
    """Makes `RemoteStore`s, closed at teardown. A store bounds Mooncake's transfers by its
    timeout process-wide, unless bounded already (`bound_mooncake_transfers`): each test starts
    unbounded, so that its first store sets its own bound, not one left by an earlier test."""
    stores: list[RemoteStore] = []
    saved = {name: os.environ.pop(name, None) for name in MOONCAKE_TCP_BOUNDS}

    def make(config: RemoteConfig) -> RemoteStore:
        stores.append(RemoteStore(config))
        return stores[-1]

    try:
        yield make
    finally:
        for store in stores:
            store.close()
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
