"""The scheduler's view of the remote store with tensor parallelism: each rank's last report
counts until that rank reports again (issue #24 finding 6)."""

from __future__ import annotations

import pytest

from tests.helpers.tier_steps import REMOTE, remote_report, remote_tier
from tests.unit.test_coordinator import _default_config, coordinator  # noqa: F401 (fixture)
from vllm_ascend_chunk.core.step import ChunkCacheWorkerMetadata
from vllm_ascend_chunk.worker.chunk_worker import worker_rank


def report(rank: int, up: bool) -> ChunkCacheWorkerMetadata:
    """What worker `rank` reports when its store's state changed (`RemoteStoreWorker.finish`)."""
    return remote_report(up={rank: up}, counters={rank: {"errors": int(not up)}})


def test_a_rank_that_stays_down_is_not_outvoted() -> None:
    coord = coordinator(16, has_remote=True)
    # Step 1: rank 0 loses the store, rank 1 still reaches it: down.
    coord.update_connector_output(report(0, False).aggregate(report(1, True)))
    assert not remote_tier(coord).reachable
    # Step 2: only rank 1 has something new to report (its counters); rank 0 is still down.
    coord.update_connector_output(report(1, True))
    assert not remote_tier(coord).reachable
    # Rank 0 is back: up.
    coord.update_connector_output(report(0, True))
    assert remote_tier(coord).reachable


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_aggregate_keeps_every_rank(order: tuple[int, int]) -> None:
    a, b = (report(r, r == 1) for r in order)
    assert {rank: r.up for rank, r in a.aggregate(b).tiers[REMOTE].items()} == {0: False, 1: True}


def test_ranks_are_numbered_as_vllm_numbers_an_engines_workers() -> None:
    """Stage major, then tensor-parallel rank: the keys of every tier's reports."""
    assert [worker_rank(tp, 4, pp) for tp, pp in [(0, 0), (3, 0), (0, 1), (3, 1)]] == [0, 3, 4, 7]
