"""RemoteStore against real Mooncake processes (a master and a standalone store process)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from harness.mooncake_store import MooncakeProcs, wait_for
from tests.store.test_kv_object import header as kv_header
from vllm_ascend_chunk.config.settings import RemoteConfig
from vllm_ascend_chunk.tiers.mooncake.kv_object import KVHeader, encode
from vllm_ascend_chunk.tiers.mooncake.objects import probe
from vllm_ascend_chunk.tiers.mooncake.store import RemoteStore

TIMEOUT_S = 1.0
RETRY_S = 0.3
MakeStore = Callable[[RemoteConfig], RemoteStore]


def header(name: str, **changes) -> KVHeader:
    shape = {"num_tokens": 64, "num_layers": 4, "head_size": 32}
    return kv_header(torch.bfloat16, key=name.encode().hex(), **{**shape, **changes})


def kv_for(h: KVHeader, seed: int = 0) -> torch.Tensor:
    return torch.randn(h.shape, generator=torch.Generator().manual_seed(seed)).to(h.torch_dtype)


def connected(procs: MooncakeProcs, make: MakeStore, **overrides) -> RemoteStore:
    store = make(procs.config(**{"timeout_s": TIMEOUT_S, "retry_s": RETRY_S, **overrides}))
    wait_for(lambda: store.up, 10, "client connected")
    return store


def written(store: RemoteStore, name: str, h: KVHeader, kv: torch.Tensor) -> None:
    """Put, and wait until the writer has handled it."""
    before = store.stats()
    store.put(name, h, kv)
    wait_for(lambda: store.stats() != before, 10, f"put {name}")


def get(store: RemoteStore, name: str, h: KVHeader) -> tuple[torch.Tensor | None, float]:
    """The result of a get, and how long it took."""
    start = time.monotonic()
    kv = store.get(name, h).result(timeout=30)
    return kv, time.monotonic() - start


def raw_client(procs: MooncakeProcs):
    """A plain Mooncake client, to write what RemoteStore never would."""
    return procs.raw_client()


def test_roundtrip_and_second_instance(mooncake: MooncakeProcs, remote_store: MakeStore) -> None:
    a = connected(mooncake, remote_store)
    h = header("doc-1")
    kv = kv_for(h)
    written(a, "doc-1", h, kv)
    assert a.stats().puts == 1 and a.stats().bytes_written > kv.nbytes
    out, _ = get(a, "doc-1", h)
    assert out is not None and torch.equal(out, kv)
    # Written again: already there, skipped.
    written(a, "doc-1", h, kv)
    assert a.stats().put_skips == 1
    # Instance B, started later, reads what A wrote.
    b = connected(mooncake, remote_store)
    out, _ = get(b, "doc-1", h)
    assert out is not None and torch.equal(out, kv)
    assert b.stats().hits == 1 and b.stats().bytes_read == a.stats().bytes_written


_EXIT_WITHOUT_CLOSE = """
import sys
from tests.store.test_remote_store import header, kv_for
from harness.mooncake_store import wait_for
from vllm_ascend_chunk.config.settings import RemoteConfig
from vllm_ascend_chunk.tiers.mooncake.store import RemoteStore
master, metadata, prefix = sys.argv[1:]
store = RemoteStore(RemoteConfig(master=master, metadata_server=metadata, timeout_s=1.0))
wait_for(lambda: store.up, 10, "client connected")
for i in range(8):
    h = header(f"{prefix}-{i}")
    store.put(f"{prefix}-{i}", h, kv_for(h, i))
"""


def test_a_process_that_exits_without_close_ends_cleanly_with_its_writes(
    mooncake: MooncakeProcs, remote_store: MakeStore
) -> None:
    """Queued writes at exit: flushed, and no abort from Mooncake's threads (before the exit
    hook, 9 of 10 such processes died of SIGABRT)."""
    for run in range(3):
        name = f"exit-{run}"
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _EXIT_WITHOUT_CLOSE,
                mooncake.master_address,
                mooncake.metadata_server,
                name,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    store = connected(mooncake, remote_store)
    for run in range(3):
        h = header(f"exit-{run}-7")
        out, _ = get(store, f"exit-{run}-7", h)
        assert out is not None and torch.equal(out, kv_for(h, 7))


def test_objects_larger_than_the_transfer_buffer_go_in_parts(
    mooncake: MooncakeProcs, remote_store: MakeStore
) -> None:
    """A 1K-token document of an 8B model is ~128 MiB: over Mooncake's 64 MiB client buffer,
    which one get or put cannot exceed (before parts, such writes failed and took the tier down)."""
    store = connected(mooncake, remote_store)
    h = header("doc-big", num_tokens=640, num_layers=16, num_kv_heads=8, head_size=128)  # 80 MiB
    kv = kv_for(h)
    written(store, "doc-big", h, kv)
    out, _ = get(store, "doc-big", h)
    assert out is not None and torch.equal(out, kv)
    assert store.stats().errors == 0 and store.up


def test_an_object_missing_a_part_is_a_miss(mooncake: MooncakeProcs, remote_store: MakeStore) -> None:
    store = connected(mooncake, remote_store, part_bytes=16 << 10)
    h = header("doc-parts")  # 64 KiB and a header: five parts
    written(store, "doc-parts", h, kv_for(h))
    assert get(store, "doc-parts", h)[0] is not None
    # Its first part alone, as if the others were evicted.
    assert raw_client(mooncake).put("doc-lone", encode(header("doc-lone"), kv_for(h))[: 16 << 10]) == 0
    out, _ = get(store, "doc-lone", header("doc-lone"))
    assert out is None and store.stats().misses == store.stats().incomplete == 1 and store.stats().errors == 0


def test_misses(mooncake: MooncakeProcs, remote_store: MakeStore) -> None:
    store = connected(mooncake, remote_store)
    assert get(store, "absent", header("absent"))[0] is None
    assert store.stats().misses == store.stats().absent == 1
    h = header("doc-2")
    written(store, "doc-2", h, kv_for(h))
    # Another model's entry stored under the name asked for.
    assert get(store, "doc-2", header("doc-2", model="other"))[0] is None
    assert store.stats().corrupt == 1 and store.up


def test_garbage_and_truncated(mooncake: MooncakeProcs, remote_store: MakeStore, caplog) -> None:
    store = connected(mooncake, remote_store)
    h = header("doc-3")
    raw = raw_client(mooncake)
    try:
        assert raw.put("garbage", b"not a kv object" * 100) == 0
        assert raw.put("truncated", encode(h, kv_for(h))[:-100]) == 0
    finally:
        raw.close()
    with caplog.at_level(logging.WARNING, logger="vllm.chunk_cache"):
        assert get(store, "garbage", h)[0] is None
        assert get(store, "truncated", h)[0] is None
    assert store.stats().corrupt == 2 and store.up
    # Rate-limited: one warning for both.
    assert sum("ignoring object" in r.getMessage() for r in caplog.records) == 1


def test_master_down_at_start(own_mooncake: MooncakeProcs, remote_store: MakeStore, caplog) -> None:
    own_mooncake.kill_master()
    with caplog.at_level(logging.INFO, logger="vllm.chunk_cache"):
        store = remote_store(own_mooncake.config(timeout_s=TIMEOUT_S, retry_s=RETRY_S))
        time.sleep(3 * RETRY_S)
        assert not store.up
        h = header("doc-4")
        out, took = get(store, "doc-4", h)
        assert out is None and took < 0.1
        store.put("doc-4", h, kv_for(h))
        assert store.stats().put_drops == store.stats().put_store_down == 1
        assert store.stats().get_store_down == 1  # the get above
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unavailable" in warnings[0].message
        start = time.monotonic()
        own_mooncake.start_master()
        wait_for(lambda: store.up, 5 * RETRY_S + 5, "reconnected")
        print(f"reconnected {time.monotonic() - start:.2f} s after the master started")
    assert any("connected to" in r.message for r in caplog.records)
    written(store, "doc-4", h, kv_for(h))
    assert torch.equal(get(store, "doc-4", h)[0], kv_for(h))


def test_master_killed_and_restarted(own_mooncake: MooncakeProcs, remote_store: MakeStore, caplog) -> None:
    store = connected(own_mooncake, remote_store)
    h = header("doc-5")
    written(store, "doc-5", h, kv_for(h))
    caplog.set_level(logging.INFO, logger="vllm.chunk_cache")
    own_mooncake.kill_master()
    results = [get(store, "doc-5", h) for _ in range(3)]
    print("gets with the master dead took", [f"{took:.2f}" for _, took in results])
    assert all(kv is None and took < TIMEOUT_S + 0.5 for kv, took in results)
    # The first read times out (a miss; the next may too, while the probe that follows runs);
    # the probe finds the master gone.
    stats = store.stats()
    assert stats.timeouts >= 1 and stats.timeouts + stats.errors == 3 and not store.up
    start = time.monotonic()
    own_mooncake.start_master()
    wait_for(lambda: store.up, 5 * RETRY_S + 5, "reconnected")
    print(f"up {time.monotonic() - start:.2f} s after the master started (store process included)")
    # The restarted master has an empty index: objects written before are gone.
    assert get(store, "doc-5", h)[0] is None and store.stats().misses == stats.misses + 1
    written(store, "doc-5", h, kv_for(h))
    assert torch.equal(get(store, "doc-5", h)[0], kv_for(h))
    # Reads stuck in Mooncake while the master was dead finish late; they do not count as a new outage.
    time.sleep(5)
    messages = [r.message for r in caplog.records]
    assert sum("unavailable" in m for m in messages) == 1
    assert sum("is back:" in m for m in messages) == 1 and store.up, messages


def test_store_paused(own_mooncake: MooncakeProcs, remote_store: MakeStore) -> None:
    store = connected(own_mooncake, remote_store)
    h = header("doc-6")
    written(store, "doc-6", h, kv_for(h))
    own_mooncake.pause()
    try:
        out, took = get(store, "doc-6", h)
        print(f"get from the paused store resolved in {took:.2f} s")
        assert out is None and TIMEOUT_S - 0.1 < took < TIMEOUT_S + 0.5
        assert store.stats().timeouts == store.stats().misses == 1 and store.stats().errors == 0
        # The probe that follows cannot read the probe object either: an outage.
        wait_for(lambda: not store.up, 5 * TIMEOUT_S, "the paused store found down")
    finally:
        own_mooncake.resume()

    def reads() -> bool:
        return store.up and get(store, "doc-6", h)[0] is not None

    start = time.monotonic()
    wait_for(reads, 10, "reads after resume", interval_s=RETRY_S)
    print(f"reads again {time.monotonic() - start:.2f} s after resume")


def test_a_stopped_store_whose_memory_the_master_dropped_is_down(
    own_mooncake: MooncakeProcs, remote_store: MakeStore
) -> None:
    """The store process stopped for longer than the master's client lease: the master drops its
    memory and answers every write "no space" at once. That is no evidence that the store answers
    (before, the probe took it for a full store and the instance stayed up, issue 55)."""
    store = connected(own_mooncake, remote_store)
    h = header("doc-7")
    own_mooncake.pause()
    try:
        wait_for(lambda: own_mooncake.capacity() == 0, 60, "the stopped store's memory dropped")
        raw = raw_client(own_mooncake)
        try:
            assert "no room for the probe object" in probe(raw, own_mooncake.master_address, 1.0, TIMEOUT_S)
        finally:
            raw.close()
        assert store.up  # nothing has failed yet: no probe
        written(store, "doc-7", h, kv_for(h))  # refused, no space: the connector probes
        wait_for(lambda: not store.up, 5 * TIMEOUT_S, "the stopped store found down")
        stats = store.stats()
        assert (stats.put_store_full, stats.puts, stats.errors) == (1, 0, 0), stats
    finally:
        own_mooncake.resume()
    wait_for(lambda: store.up, 10, "the store back")
    written(store, "doc-7", h, kv_for(h))
    assert torch.equal(get(store, "doc-7", h)[0], kv_for(h))
