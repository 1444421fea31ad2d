"""`RemoteStore` with its real threads against an in-memory Mooncake client with switchable
faults (tests/store/ runs the real store, which cannot be made to fail at an exact point): parts
and their nonces, the bounded read and write queues, read deadlines, and outages found by a probe
and healed by the connector.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from harness.mooncake_store import wait_for
from tests.store.test_kv_object import header as kv_header
from tests.unit.test_remote_tier import GEOMETRY, IDENTITY, RETRY_S, fill, make_pool, reported_reads, step
from vllm_ascend_chunk.config.settings import RemoteConfig
from vllm_ascend_chunk.tiers.mooncake import store as store_module
from vllm_ascend_chunk.tiers.mooncake.calls import Calls, spare_cpus
from vllm_ascend_chunk.tiers.mooncake.jobs import RemoteRead, RemoteWrite
from vllm_ascend_chunk.tiers.mooncake.kv_object import KVHeader, encode, object_size
from vllm_ascend_chunk.tiers.mooncake.objects import MOONCAKE_TCP_BOUNDS, PROBE_NAME
from vllm_ascend_chunk.tiers.mooncake.store import RemoteStore
from vllm_ascend_chunk.tiers.mooncake.worker import RemoteStoreWorker

NONCE = 8
"""Bytes of the write nonce at the start of every part of a multi-part object."""

# -- RemoteStore against an in-memory Mooncake -------------------------------------------------


class FakeMooncake:
    """An in-memory Mooncake Store behind the calls `RemoteStore` makes of its client; every
    client set up while it is installed talks to it."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.down = False
        """The master does not answer: negative codes, empty reads, failing client set-ups."""
        self.fail_writes: set[str] = set()
        """Names whose write returns an error code."""
        self.held: set[str] = set()
        """Names whose reads and existence checks wait until `release`."""
        self.spinning: set[str] = set()
        """Names whose reads and existence checks busy-poll until `release` (as in a stopped
        store process)."""
        self.calls: list[tuple[str, str]] = []
        self.callers: dict[str, set[int]] = {}
        """Per operation, the CPUs of the last thread that called it."""
        self.threads: dict[tuple[str, str], int] = {}
        """Per operation and name, the native id of the last thread that called it."""
        self.setups = 0
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def called(self, op: str, name: str) -> int:
        return sum(c == (op, name) for c in list(self.calls))

    def _call(self, op: str, name: str) -> None:
        self.calls.append((op, name))
        self.threads[(op, name)] = threading.get_native_id()
        if sys.platform.startswith("linux"):
            self.callers[op] = os.sched_getaffinity(0)
        if name in self.held:
            self._released.wait(30)
        if name in self.spinning:
            deadline = time.monotonic() + 30
            while not self._released.is_set() and time.monotonic() < deadline:
                pass

    def client_class(self) -> type:
        fake = self

        class Client:
            def setup(self, *args) -> int:
                fake.setups += 1
                return -1 if fake.down else 0

            def is_exist(self, name: str) -> int:
                fake._call("is_exist", name)
                return -1 if fake.down else int(name in fake.objects)

            def get(self, name: str) -> bytes:
                fake._call("get", name)
                return b"" if fake.down else fake.objects.get(name, b"")

            def put(self, name: str, value) -> int:
                fake._call("put", name)
                if fake.down or name in fake.fail_writes:
                    return -1
                fake.objects.setdefault(name, bytes(value))
                return 0

            def upsert_parts(self, name: str, *parts) -> int:
                fake._call("upsert", name)
                if fake.down or name in fake.fail_writes:
                    return -1
                fake.objects[name] = b"".join(bytes(p) for p in parts)
                return 0

            def remove(self, name: str, force: bool = False) -> int:
                fake._call("remove", name)
                fake.objects.pop(name, None)
                return 0

            def close(self) -> None:
                pass

        return Client


class Master:
    """A listener where the Mooncake master is: the store checks that one is reachable."""

    class _Server(socketserver.TCPServer):
        request_queue_size = 64

    def __init__(self) -> None:
        self.server = self._Server(("127.0.0.1", 0), socketserver.BaseRequestHandler)
        host, port = self.server.server_address
        self.address = f"{host}:{port}"
        threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class InProcessClients:
    """Clients of `client_class` made in this process, their calls on `Calls`' threads, as in the
    client process (`tiers.mooncake.clients`, tested on its own in test_mooncake_clients.py): the
    fake's faults and what it records stay in reach of the test."""

    def __init__(self, client_class: type) -> None:
        self.client_class = client_class
        self.calls = Calls(store_module.STUCK_CALL_S, spare_cpus())

    def new(self) -> object:
        client = self.client_class()
        calls = self.calls

        class Guarded:
            def __getattr__(self, method: str) -> Callable[..., object]:
                return lambda *args: calls.submit(getattr(client, method), *args).result()

        return Guarded()

    def close(self) -> None:
        self.calls.close()


@pytest.fixture
def mooncake(monkeypatch: pytest.MonkeyPatch) -> FakeMooncake:
    fake = FakeMooncake()
    for name in (*MOONCAKE_TCP_BOUNDS, "MC_STORE_CLIENT_SETUP_RETRIES"):
        monkeypatch.delenv(name, raising=False)  # set process-wide by a store: restored after the test
    return fake


MakeStore = Callable[..., RemoteStore]


@pytest.fixture
def make_store(mooncake: FakeMooncake) -> Iterator[MakeStore]:
    """Connected `RemoteStore`s on the fake (config overrides as keywords), closed at teardown."""
    master = Master()
    stores: list[RemoteStore] = []

    def make(**overrides) -> RemoteStore:
        config = RemoteConfig(
            master=master.address,
            metadata_server="http://127.0.0.1:1/metadata",
            **{"timeout_s": 2.0, "retry_s": RETRY_S, **overrides},
        )
        stores.append(RemoteStore(config, clients=InProcessClients(mooncake.client_class())))
        wait_for(lambda: stores[-1].up, 10, "store connected", interval_s=0.01)
        return stores[-1]

    yield make
    mooncake.release()
    for store in stores:
        store.close()
    master.close()


@pytest.fixture
def messages() -> Iterator[list[str]]:
    """What the remote store logs (vLLM's loggers do not propagate to caplog)."""
    import vllm.logger  # noqa: F401  (its set-up clears the handlers of "vllm.*" loggers)

    handler = Messages()
    logger = logging.getLogger("vllm.chunk_cache")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def header(name: str, **changes) -> KVHeader:
    return kv_header(torch.float32, key=name.encode().hex(), **{"num_tokens": 16, "head_size": 16, **changes})


def kv_for(h: KVHeader, seed: int = 0) -> torch.Tensor:
    return torch.randn(h.shape, generator=torch.Generator().manual_seed(seed)).to(h.torch_dtype)


def written(store: RemoteStore, name: str, h: KVHeader, kv: torch.Tensor) -> None:
    """Put, and wait until the writer has handled it."""
    before = store.stats()
    store.put(name, h, kv)
    wait_for(lambda: store.stats() != before, 10, f"put {name}", interval_s=0.01)


def read(store: RemoteStore, name: str, h: KVHeader) -> torch.Tensor | None:
    return store.get(name, h).result(timeout=30)


def stored_under(fake: FakeMooncake, name: str) -> list[str]:
    return sorted(n for n in fake.objects if n == name or n.startswith(name + "/"))


def test_an_object_over_part_bytes_is_stored_in_parts_of_one_write(
    mooncake: FakeMooncake, make_store: MakeStore
) -> None:
    h = header("doc")
    kv = kv_for(h)
    part_bytes = 4096
    count = -(-object_size(h) // (part_bytes - NONCE))
    assert count >= 3
    store = make_store(part_bytes=part_bytes)
    written(store, "doc", h, kv)
    names = ["doc", *(f"doc/part{i}" for i in range(1, count))]
    assert stored_under(mooncake, "doc") == sorted(names)
    parts = [mooncake.objects[n] for n in names]
    assert all(len(p) <= part_bytes for p in parts)
    assert len({p[:NONCE] for p in parts}) == 1
    assert b"".join(p[NONCE:] for p in parts) == encode(h, kv)
    assert mooncake.calls.index(("upsert", "doc")) > mooncake.calls.index(("upsert", "doc/part2"))
    assert torch.equal(read(store, "doc", h), kv)
    nonce = parts[0][:NONCE]
    for n in names:
        del mooncake.objects[n]
    written(store, "doc", h, kv)
    assert mooncake.objects["doc"][:NONCE] != nonce, "two writes drew the same nonce"
    assert store.stats().errors == 0


def test_the_threads_calling_mooncake_run_off_the_compute_cores(
    mooncake: FakeMooncake, make_store: MakeStore
) -> None:
    """A store made by a thread bound to CPU 0 (as vLLM's CPU worker binds its threads to its
    compute cores): its readers, writer and connector call Mooncake on the other CPUs."""
    stores: list[RemoteStore] = []

    def bound_maker() -> None:
        os.sched_setaffinity(0, {0})
        stores.append(make_store())

    maker = threading.Thread(target=bound_maker)
    maker.start()
    maker.join()
    h = header("e")
    written(stores[0], "e", h, kv_for(h))
    assert read(stores[0], "e", h) is not None
    others = (set(range(os.cpu_count() or 1)) - {0}) or {0}
    # put and is_exist by the writer and the probe, get by a reader and the probe
    assert mooncake.callers == dict.fromkeys(mooncake.callers, others)
    assert {"put", "get", "is_exist"} <= set(mooncake.callers)


def _nice(mooncake: FakeMooncake, op: str, name: str) -> int | None:
    """The nice value of the thread that last called `op` on `name` (None: not yet, or it ended)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, mooncake.threads[(op, name)])
    except (KeyError, OSError):
        return None


per_thread_priorities = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="priorities per thread"
)


@per_thread_priorities
def test_a_spinning_call_drops_its_thread_to_nice_19_and_the_calls_after_it_run_at_normal_priority(
    mooncake: FakeMooncake, make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read spinning in the store (as in a stopped store process) has its thread demoted; another
    read meanwhile runs on a thread at the normal priority, and the demoted thread ends once its
    call returns."""
    monkeypatch.setattr(store_module, "STUCK_CALL_S", 0.05)
    store = make_store(timeout_s=60.0)  # the held read's deadline is far: a busy machine ends no read early
    slow, fast = header("slow"), header("fast")
    written(store, "slow", slow, kv_for(slow))
    written(store, "fast", fast, kv_for(fast, 1))
    normal = os.getpriority(os.PRIO_PROCESS, 0)
    mooncake.spinning.add("slow")
    pending = store.get("slow", slow)
    wait_for(lambda: _nice(mooncake, "get", "slow") == 19, 30, "the spinning read's thread demoted")
    assert torch.equal(read(store, "fast", fast), kv_for(fast, 1))
    assert mooncake.threads[("get", "fast")] != mooncake.threads[("get", "slow")]
    assert _nice(mooncake, "get", "fast") == normal
    mooncake.release()
    assert torch.equal(pending.result(30), kv_for(slow))  # released before its deadline: a hit
    stuck = mooncake.threads[("get", "slow")]
    wait_for(lambda: not os.path.exists(f"/proc/self/task/{stuck}"), 30, "the demoted thread ended")


@per_thread_priorities
def test_a_slow_call_that_does_not_spin_keeps_its_priority_and_its_thread(
    mooncake: FakeMooncake, make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that waits (as one starved on a machine whose cores engines keep busy) is not
    stuck, however long it runs: demoting it would starve it further."""
    monkeypatch.setattr(store_module, "STUCK_CALL_S", 0.05)
    store = make_store(timeout_s=60.0)
    slow = header("slow")
    written(store, "slow", slow, kv_for(slow))
    normal = os.getpriority(os.PRIO_PROCESS, 0)
    mooncake.held.add("slow")
    pending = store.get("slow", slow)
    wait_for(lambda: mooncake.called("get", "slow") == 1, 30, "the read started")
    time.sleep(0.5)  # ten times `STUCK_CALL_S`, in a call that spends no CPU
    assert _nice(mooncake, "get", "slow") == normal
    mooncake.release()
    assert torch.equal(pending.result(30), kv_for(slow))
    time.sleep(0.2)
    assert _nice(mooncake, "get", "slow") == normal  # alive: back in the pool


@pytest.mark.parametrize(("extra", "parts"), [(0, 1), (-1, 2)], ids=["exactly-part-bytes", "one-byte-over"])
def test_the_part_boundary(mooncake: FakeMooncake, make_store: MakeStore, extra: int, parts: int) -> None:
    h = header("doc")
    kv = kv_for(h)
    store = make_store(part_bytes=object_size(h) + extra)
    written(store, "doc", h, kv)
    assert len(stored_under(mooncake, "doc")) == parts
    if parts == 1:
        assert mooncake.objects["doc"] == encode(h, kv)  # a lone part carries no nonce
    assert torch.equal(read(store, "doc", h), kv)


def _lose(parts: dict[str, bytes]) -> None:
    del parts["doc/part1"]


def _mix(parts: dict[str, bytes]) -> None:
    """Part 1 of another write of the same name: same bytes, another nonce."""
    part = parts["doc/part1"]
    parts["doc/part1"] = bytes(b ^ 0xFF for b in part[:NONCE]) + part[NONCE:]


def _only_nonce(parts: dict[str, bytes]) -> None:
    parts["doc/part2"] = parts["doc/part2"][:NONCE]


@pytest.mark.parametrize("damage", [_lose, _mix, _only_nonce], ids=["lost", "mixed", "nonce-only"])
def test_an_incomplete_object_is_a_miss_that_the_next_writer_heals(
    mooncake: FakeMooncake, make_store: MakeStore, damage: Callable[[dict[str, bytes]], None]
) -> None:
    store = make_store(part_bytes=4096)
    h = header("doc")
    kv = kv_for(h)
    written(store, "doc", h, kv)
    damage(mooncake.objects)
    assert read(store, "doc", h) is None
    stats = store.stats()
    assert (stats.misses, stats.corrupt, stats.errors, stats.hits) == (1, 0, 0, 0)
    assert "doc" not in mooncake.objects, "the damaged object outlived its read"
    written(store, "doc", h, kv)
    assert store.stats().puts == 2
    assert torch.equal(read(store, "doc", h), kv)


@pytest.mark.parametrize("failing", ["doc/part2", "doc"], ids=["a-part", "the-first-part"])
def test_a_part_that_fails_to_write_leaves_no_parts(
    mooncake: FakeMooncake, make_store: MakeStore, failing: str
) -> None:
    store = make_store(part_bytes=4096)
    h = header("doc")
    mooncake.fail_writes.add(failing)
    calls = len(mooncake.calls)
    written(store, "doc", h, kv_for(h))
    assert stored_under(mooncake, "doc") == []
    assert store.stats().errors == 1 and store.stats().puts == 0
    # The failure makes the connector probe the store; the probe passes: not an outage.
    wait_for(lambda: any(not n.startswith("doc") for _, n in mooncake.calls[calls:]), 10, "the store probed")
    time.sleep(2 * RETRY_S)
    assert store.up
    mooncake.fail_writes.clear()
    written(store, "doc", h, kv_for(h))
    assert torch.equal(read(store, "doc", h), kv_for(h))


def test_corrupt_and_foreign_objects_are_removed(mooncake: FakeMooncake, make_store: MakeStore) -> None:
    """Another model's object under this name is of use to no reader of the name (it is made of
    the entry key and the shard): removed like a corrupt one, so the next writer replaces it."""
    store = make_store()
    h = header("doc")
    mooncake.objects["doc"] = encode(h, kv_for(h))[:-1]
    mooncake.objects["theirs"] = encode(header("theirs", model="other"), kv_for(h))
    assert read(store, "doc", h) is None and read(store, "theirs", header("theirs")) is None
    assert store.stats().corrupt == 2 and store.stats().errors == 0 and store.up
    assert "doc" not in mooncake.objects and "theirs" not in mooncake.objects


def test_gets_beyond_the_read_queue_miss_at_once(mooncake: FakeMooncake, make_store: MakeStore) -> None:
    store = make_store(read_queue=2, timeout_s=10.0)
    mooncake.held.add("slow")
    h = header("slow")
    reading = [store.get("slow", h) for _ in range(2)]
    wait_for(lambda: mooncake.called("get", "slow") == 2, 10, "both readers busy")
    waiting = [store.get("slow", h) for _ in range(2)]
    refused = store.get("slow", h)
    assert refused.done() and refused.result() is None
    assert not any(f.done() for f in reading + waiting)
    stats = store.stats()
    assert (stats.misses, stats.get_drops, stats.errors) == (1, 1, 0)
    mooncake.release()
    assert [f.result(timeout=10) for f in reading + waiting] == [None] * 4  # absent: misses
    assert store.stats().misses == 5 and store.stats().get_drops == 1 and store.up


def test_a_read_past_its_deadline_misses_and_is_not_an_outage(
    mooncake: FakeMooncake, make_store: MakeStore
) -> None:
    timeout_s = 0.2
    store = make_store(timeout_s=timeout_s)
    h = header("doc")
    kv = kv_for(h)
    written(store, "doc", h, kv)
    mooncake.held.add("doc")
    calls = len(mooncake.calls)
    start = time.monotonic()
    assert read(store, "doc", h) is None
    took = time.monotonic() - start
    assert timeout_s - 0.05 < took < timeout_s + 1.0
    stats = store.stats()
    assert (stats.timeouts, stats.misses, stats.errors, stats.hits) == (1, 1, 0, 0)
    # The slow read makes the connector probe the store; the probe passes: still up.
    wait_for(lambda: any(n != "doc" for _, n in mooncake.calls[calls:]), 10, "the store probed")
    time.sleep(2 * RETRY_S)
    assert store.up
    # The stuck read ends late: its result is dropped, not counted.
    mooncake.release()
    assert torch.equal(read(store, "doc", h), kv)
    assert store.stats().hits == 1


def test_no_read_starts_while_the_probe_a_timeout_called_for_is_pending(
    mooncake: FakeMooncake, make_store: MakeStore
) -> None:
    """A read started into a store that just let one time out would likely hang too (and in a
    stopped Mooncake store keep a core busy): readers wait for the probe's verdict. Here the probe
    hangs, then finds the master gone: the read asked meanwhile never reaches the store."""
    store = make_store(timeout_s=1.0)
    h = header("doc")
    written(store, "doc", h, kv_for(h))
    mooncake.held.update({"slow", PROBE_NAME})
    assert store.get("slow", header("slow")).result(timeout=10) is None  # timed out: suspect
    wait_for(lambda: mooncake.called("is_exist", PROBE_NAME), 10, "the probe under way", interval_s=0.01)
    asked = store.get("doc", h)  # one reader is free
    time.sleep(0.2)
    assert not asked.done() and mooncake.called("get", "doc") == 0, "a read started during the probe"
    mooncake.down = True
    mooncake.release()
    assert asked.result(timeout=10) is None
    assert mooncake.called("get", "doc") == 0 and not store.up
    assert store.stats().timeouts == 1


def test_an_outage_drains_the_reads_drops_the_writes_and_heals(
    mooncake: FakeMooncake, make_store: MakeStore, messages: list[str]
) -> None:
    store = make_store(timeout_s=0.2)
    h = header("doc")
    kv = kv_for(h)
    written(store, "doc", h, kv)
    # Both readers stuck in the store, two gets waiting behind them; then the master stops answering.
    mooncake.held.update({"slow-0", "slow-1"})
    stuck = [store.get(f"slow-{i}", header(f"slow-{i}")) for i in range(2)]
    wait_for(lambda: all(mooncake.called("get", f"slow-{i}") for i in range(2)), 10, "readers stuck")
    waiting = [store.get("doc", h) for _ in range(2)]
    mooncake.down = True
    # The stuck reads time out, the probe that follows fails: down, and the waiting gets resolve.
    assert [f.result(timeout=10) for f in stuck + waiting] == [None] * 4
    wait_for(lambda: not store.up, 10, "store down")
    stats = store.stats()
    assert stats.timeouts == 2 and stats.hits == 0 and stats.errors >= 2
    # Down: gets miss at once, puts are dropped.
    miss = store.get("doc", h)
    assert miss.done() and miss.result() is None
    store.put("new", h, kv)
    assert store.stats().put_drops == 1
    # The connector keeps trying (fresh clients too); one warning for the whole outage.
    setups = mooncake.setups
    wait_for(lambda: mooncake.setups >= setups + 3, 10, "reconnection attempts")
    assert not store.up
    assert sum("unavailable" in m for m in messages) == 1, messages
    mooncake.down = False
    wait_for(lambda: store.up, 10, "store back")
    assert sum("is back:" in m for m in messages) == 1, messages
    mooncake.release()
    assert torch.equal(read(store, "doc", h), kv)
    written(store, "new", h, kv)
    assert "new" in mooncake.objects


def test_mooncake_transfers_are_bounded_a_second_past_the_read_timeout(
    mooncake: FakeMooncake, make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stalled transfer outlives the read's deadline, which settles the get as a timeout first;
    a bound the user set is kept."""
    make_store(timeout_s=1.5)
    assert [os.environ[name] for name in MOONCAKE_TCP_BOUNDS] == ["3", "3"]
    monkeypatch.setenv(MOONCAKE_TCP_BOUNDS[0], "7")
    make_store(timeout_s=1.0)
    assert [os.environ[name] for name in MOONCAKE_TCP_BOUNDS] == ["7", "3"]


def test_puts_over_the_queued_bytes_bound_are_dropped(mooncake: FakeMooncake, make_store: MakeStore) -> None:
    h = header("w0")
    store = make_store(queue_bytes=int(2.5 * h.payload_bytes))
    mooncake.held.add("w0")  # the writer is stuck on the first put
    for i in range(3):
        store.put(f"w{i}", header(f"w{i}"), kv_for(h, i))
    assert store.stats().put_drops == 1
    mooncake.release()
    wait_for(lambda: store.stats().puts == 2, 10, "queued puts written")
    assert {"w0", "w1"} <= mooncake.objects.keys() and "w2" not in mooncake.objects
    written(store, "w3", header("w3"), kv_for(h, 3))
    assert store.stats().puts == 3 and store.stats().errors == 0


def test_kv_not_matching_its_header_is_dropped_not_an_error(
    mooncake: FakeMooncake, make_store: MakeStore
) -> None:
    store = make_store()
    h = header("doc")
    written(store, "doc", h, kv_for(header("doc", num_tokens=3)))
    assert store.stats().put_drops == 1 and store.stats().errors == 0 and store.up
    assert "doc" not in mooncake.objects


def test_close_writes_the_queued_puts_first_then_refuses(
    mooncake: FakeMooncake, make_store: MakeStore
) -> None:
    store = make_store()
    h = header("doc")
    for i in range(3):
        store.put(f"doc-{i}", header(f"doc-{i}"), kv_for(h, i))
    store.close()
    assert {f"doc-{i}" for i in range(3)} <= mooncake.objects.keys()
    got = store.get("doc-0", header("doc-0"))
    assert got.done() and got.result() is None
    store.put("doc-9", header("doc-9"), kv_for(h))
    assert store.stats().put_drops == 1 and not store.up
    store.close()  # again: nothing happens


def test_tensor_parallel_shards_round_trip_between_engines(
    mooncake: FakeMooncake, make_store: MakeStore
) -> None:
    """Two ranks write their shards of an entry; the ranks of another engine read each its own
    shard into other rows; an engine of another TP size or model misses."""

    def ranks(size: int, **changes) -> list[RemoteStoreWorker]:
        return [
            RemoteStoreWorker(
                make_store(), GEOMETRY, dataclasses.replace(IDENTITY, tp_rank=r, tp_size=size, **changes)
            )
            for r in range(size)
        ]

    writers, readers = ranks(2), ranks(2)
    shards = [make_pool() for _ in writers]
    for seed, (tier, pool) in enumerate(zip(writers, shards, strict=True)):
        fill(pool, seed)
        tier.save(step(writes=[RemoteWrite(key=b"doc", rows=[0, 1, 2, 3, 4])]), pool)
    for tier in writers:
        wait_for(lambda t=tier: t.store.stats().puts == 1, 10, "shard written")
    for tier, shard in zip(readers, shards, strict=True):
        pool = make_pool()
        tier.start(step(reads=[RemoteRead(read_id=1, key=b"doc", rows=[11, 12, 13, 14, 15])]), pool)
        assert reported_reads(tier, pool) == {1: True}
        assert torch.equal(pool.kv[:, :, 11:16], shard.kv[:, :, 0:5])
    for tier in [*ranks(1), ranks(2, model="other")[0]]:
        pool = make_pool()
        tier.start(step(reads=[RemoteRead(read_id=2, key=b"doc", rows=[0, 1, 2, 3, 4])]), pool)
        assert reported_reads(tier, pool) == {2: False}
