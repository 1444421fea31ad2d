"""Bookkeeping invariants of a `ChunkCacheCoordinator`, shared by the coordinator tests (fake
engine) and the async scheduler tests (real vLLM scheduler)."""

from __future__ import annotations

from collections.abc import Mapping

from tests.helpers.tier_steps import remote_tier
from vllm_ascend_chunk.scheduler.coordinator import ChunkCacheCoordinator
from vllm_ascend_chunk.scheduler.prefills import ChunkPrefill
from vllm_ascend_chunk.scheduler.requests import ChunkPathStatus
from vllm_ascend_chunk.tiers.host.scheduler import HostTier


def check_bookkeeping(coord: ChunkCacheCoordinator, live_prefills: Mapping[str, ChunkPrefill]) -> None:
    """Pins equal the PLANNED/LOADING users holding an entry, every such entry is in the index,
    free pages and entry pages partition the pool, every pending entry has a live prefill, a
    remote read in flight or one that failed and awaits its prefill, no live prefill or remote
    read writes a free page, and host pages partition the host tier."""
    manager = coord.manager
    remote = remote_tier(coord)
    reading = list(remote.in_flight.values()) if remote is not None else []
    dropped = {id(e): e for p in live_prefills.values() for e in p.entries if e.dropped}
    dropped.update({id(e): e for u in coord.users.values() for e in (u.entries or []) if e.dropped})
    dropped.update({id(e): e for e in reading + manager.refills if e.dropped})
    taken = [p for e in [*manager.entries.values(), *dropped.values()] for p in e.pages]
    assert len(taken) == len(set(taken)), "a page belongs to two entries"
    assert sorted(taken + manager.free_pages) == list(range(manager.num_pages))
    pins: dict[int, int] = {}
    for user in coord.users.values():
        holds = user.status in (ChunkPathStatus.PLANNED, ChunkPathStatus.LOADING)
        assert (user.entries is not None) == holds
        for entry in {id(e): e for e in user.entries or []}.values():
            pins[id(entry)] = pins.get(id(entry), 0) + 1
            assert manager.entries.get(entry.key) is entry, "a pinned entry left the pool"
    for entry in [*manager.entries.values(), *dropped.values()]:
        assert entry.dropped == (manager.entries.get(entry.key) is not entry), entry.state
        assert entry.pins == pins.get(id(entry), 0)
        if not entry.resident:
            computed = any(entry in p.entries for p in live_prefills.values())
            assert computed or entry in reading or entry in manager.refills, "orphan pending entry"
            assert entry.fetching == (entry in reading)
    for entry in [e for p in live_prefills.values() for e in p.entries] + reading:
        assert not set(entry.pages) & set(manager.free_pages), "free page still written"
    for host in (t.index for t in manager.tiers if isinstance(t, HostTier)):
        held = [*host.entries.values(), *host.retired]  # retired: free after the step
        host_taken = [p for e in held for p in e.pages]
        assert sorted(host_taken + host.free_pages) == list(range(host.num_pages))


def check_drained(coord: ChunkCacheCoordinator) -> None:
    """Nothing pinned or pending is left, and the pool's used pages are exactly its entries'."""
    manager = coord.manager
    remote = remote_tier(coord)
    assert not (remote is not None and remote.in_flight) and not manager.refills
    assert manager.pinned_entries == 0 and all(e.resident for e in manager.entries.values())
    assert manager.used_pages == sum(len(e.pages) for e in manager.entries.values())
