"""The scheduler's view of the remote store with tensor parallelism: each rank's last report
counts until that rank reports again (issue #24 finding 6)."""

from __future__ import annotations

import pytest

from tests.unit.test_coordinator import _default_config, coordinator  # noqa: F401 (fixture)
from vllm_ascend_chunk.core.step import ChunkCacheWorkerMetadata


def report(rank: int, up: bool) -> ChunkCacheWorkerMetadata:
    """What `RemoteTier.finish` of worker `rank` returns when its store's state changed."""
    return ChunkCacheWorkerMetadata(remote_up={rank: up}, remote_counters={rank: {"errors": int(not up)}})


def test_a_rank_that_stays_down_is_not_outvoted() -> None:
    coord = coordinator(16, has_remote=True)
    # Step 1: rank 0 loses the store, rank 1 still reaches it: down.
    coord.update_connector_output(report(0, False).aggregate(report(1, True)))
    assert not coord.remote.reachable
    # Step 2: only rank 1 has something new to report (its counters); rank 0 is still down.
    coord.update_connector_output(report(1, True))
    assert not coord.remote.reachable
    # Rank 0 is back: up.
    coord.update_connector_output(report(0, True))
    assert coord.remote.reachable


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_aggregate_keeps_every_rank(order: tuple[int, int]) -> None:
    a, b = (report(r, r == 1) for r in order)
    assert a.aggregate(b).remote_up == {0: False, 1: True}
