"""RemoteStore under load and partial failures, against real Mooncake processes (issue #24
findings 3-5): a burst of reads, objects that lost or mixed parts, a full store."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.mooncake_store import MooncakeProcs
from tests.store.test_remote_store import MakeStore, connected, get, header, kv_for, raw_client, written
from vllm_ascend_chunk.tiers.mooncake.objects import (
    MOONCAKE_TCP_BOUNDS,
    NO_SPACE,
    PROBE_NAME,
    PROBE_VALUE,
    probe,
)

MIB = 1 << 20


@pytest.fixture
def small_mooncake(tmp_path: Path) -> Iterator[MooncakeProcs]:
    """A store that holds seven 4 MiB objects."""
    procs = MooncakeProcs(tmp_path, store_bytes=32 * MIB)
    try:
        yield procs.start()
    finally:
        procs.stop()


BURST_READS, BURST_TIMEOUT_S = 400, 3.0
"""A burst that outlasts the read timeout (400 gets of ~25-75 ms each), and a timeout that one
read on a busy 2-core machine stays well inside (at 1 s, 3 of 200 reads of a CI run passed it
while the other test worker compiled an engine)."""


def test_a_burst_of_reads_is_queued_not_timed_out(mooncake: MooncakeProcs, remote_store: MakeStore) -> None:
    """400 gets of an 8 MiB object at once, for longer than the read timeout: each read's
    deadline counts from its start, so reads that end later than the timeout after the burst was
    submitted still hit; no thread per get; a read that does time out is counted as a timeout,
    never as a store error; the store stays up (before: 200 gets with a 1 s timeout gave 58 hits,
    142 timeouts counted as store errors, ~200 timer threads, the store declared down).

    It asserts what the design guarantees, not a wall-clock outcome: under load a single read
    may still pass its own timeout (3 of 400 did in one CI run), and that is a timeout."""
    # The store bounds Mooncake's TCP transfers by a second more than its own timeout (a bound
    # left by an earlier store with a shorter timeout once failed a read of this burst as an error).
    store = connected(mooncake, remote_store, timeout_s=BURST_TIMEOUT_S)
    assert all(os.environ[name] == f"{BURST_TIMEOUT_S + 1:.0f}" for name in MOONCAKE_TCP_BOUNDS)
    h = header("burst", num_tokens=1024, num_layers=8, num_kv_heads=2, head_size=128)
    assert h.payload_bytes == 8 * MIB
    kv = kv_for(h)
    written(store, "burst", h, kv)
    threads = threading.active_count()
    start = time.monotonic()
    futures = [store.get("burst", h) for _ in range(BURST_READS)]
    extra_threads = threading.active_count() - threads
    hits = late_hits = 0
    while futures:  # each result checked and dropped as it comes (400 x 8 MiB held would be 3.2 GiB)
        result = futures.pop(0).result(timeout=240)
        hit = result is not None
        assert not hit or torch.equal(result, kv)
        hits += hit
        late_hits += hit and time.monotonic() - start > BURST_TIMEOUT_S
    elapsed = time.monotonic() - start
    stats = store.stats()
    print(f"{hits} hits ({late_hits} after the timeout) in {elapsed:.1f} s; {extra_threads} extra threads")
    print(stats)
    assert extra_threads <= 2
    assert elapsed > BURST_TIMEOUT_S, "the burst must outlast the timeout, or it shows nothing"
    assert late_hits > 0, "a read queued past the timeout is not timed out by its wait in the queue"
    assert stats.hits == hits and stats.timeouts == BURST_READS - hits
    assert store.up and stats.errors == 0


def test_reads_given_up_by_the_caller_do_not_transfer(
    mooncake: MooncakeProcs, remote_store: MakeStore
) -> None:
    store = connected(mooncake, remote_store)
    h = header("abandoned", num_tokens=1024, num_layers=8, num_kv_heads=2, head_size=128)
    written(store, "abandoned", h, kv_for(h))
    futures = [store.get("abandoned", h) for _ in range(100)]
    cancelled = sum(f.cancel() for f in futures)
    store.get("absent", header("absent")).result(timeout=30)  # after the queue: all handled
    stats = store.stats()
    print(f"{cancelled} cancelled; {stats}")
    assert cancelled >= 90 and stats.hits <= 100 - cancelled
    assert stats.bytes_read <= (100 - cancelled) * (h.payload_bytes + 1024)
    assert store.up and stats.errors == 0


def test_an_object_that_lost_a_part_is_rewritten(mooncake: MooncakeProcs, remote_store: MakeStore) -> None:
    store = connected(mooncake, remote_store, part_bytes=16 << 10)
    h = header("heal-lost")  # 64 KiB and a header: five parts
    kv = kv_for(h)
    written(store, "heal-lost", h, kv)
    assert torch.equal(get(store, "heal-lost", h)[0], kv)
    raw = raw_client(mooncake)
    try:
        assert raw.remove("heal-lost/part1", True) == 0  # evicted alone
    finally:
        raw.close()
    assert get(store, "heal-lost", h)[0] is None
    # The next writer (a worker that computed the entry after the miss) writes it again.
    written(store, "heal-lost", h, kv)
    out, _ = get(store, "heal-lost", h)
    assert out is not None and torch.equal(out, kv)
    assert store.up and store.stats().errors == 0


def test_an_object_with_parts_of_two_writes_is_a_miss_and_rewritten(
    mooncake: MooncakeProcs, remote_store: MakeStore
) -> None:
    """Two writers racing on one name can leave parts of both (Mooncake's `put` keeps an existing
    object): simulated by copying a part of another object of the same size over one part."""
    store = connected(mooncake, remote_store, part_bytes=16 << 10)
    ha, hb = header("mix-a"), header("mix-b")
    kva = kv_for(ha, 1)
    written(store, "mix-a", ha, kva)
    written(store, "mix-b", hb, kv_for(hb, 2))
    raw = raw_client(mooncake)
    try:
        assert raw.upsert("mix-a/part2", raw.get("mix-b/part2")) == 0
    finally:
        raw.close()
    for _ in range(2):
        assert get(store, "mix-a", ha)[0] is None
    written(store, "mix-a", ha, kva)
    out, _ = get(store, "mix-a", ha)
    assert out is not None and torch.equal(out, kva)
    assert store.up and store.stats().errors == 0


def test_a_full_store_is_not_an_outage(small_mooncake: MooncakeProcs, remote_store: MakeStore) -> None:
    """Ten 4 MiB objects into a 32 MiB store: the puts that find no room (Mooncake's -200) are
    dropped, the store stays up (before: the first such put declared it unavailable)."""
    store = connected(small_mooncake, remote_store)
    hs = [header(f"full-{i}", num_tokens=512, num_layers=16, num_kv_heads=2, head_size=64) for i in range(10)]
    assert hs[0].payload_bytes == 4 * MIB
    for i, h in enumerate(hs):
        written(store, f"full-{i}", h, kv_for(h, i))
        assert store.up, f"down after {store.stats()}"
    stats = store.stats()
    print(stats)
    assert stats.put_store_full >= 1 and stats.puts + stats.put_drops == 10 and stats.errors == 0
    assert stats.put_drops == stats.put_store_full
    # Mooncake may evict some to make room: each read is the object or a miss.
    results = [get(store, f"full-{i}", h)[0] for i, h in enumerate(hs)]
    assert all(
        out is None or torch.equal(out, kv_for(h, i))
        for i, (out, h) in enumerate(zip(results, hs, strict=True))
    )
    assert store.stats().hits >= 1 and store.stats().errors == 0 and store.up


def test_the_probe_of_a_full_store_writes_its_object_once_the_store_evicts(
    small_mooncake: MooncakeProcs,
) -> None:
    """A full store may refuse even the probe's small object for a moment (no space) until it
    evicts: the probe tries again within its timeout, and passes on the object read back."""
    raw = raw_client(small_mooncake)
    try:
        rcs = [raw.put(f"fill-{i}", b"x" * (4 * MIB)) for i in range(64)]
        assert NO_SPACE in rcs, rcs  # it was full
        raw.remove(PROBE_NAME, True)
        assert probe(raw, small_mooncake.master_address, 1.0, 5.0) is None
        assert raw.get(PROBE_NAME) == PROBE_VALUE
    finally:
        raw.close()
