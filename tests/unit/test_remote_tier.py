"""`RemoteStoreWorker` without Mooncake processes (tests/store/ runs the real ones): one worker's side
(object names per tensor-parallel shard and pipeline stage, headers, reads that end in whichever step
they arrive, or at their deadline) against a
stand-in `RemoteStore` whose futures the tests settle themselves. `RemoteStore` itself:
test_remote_store_logic.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time

import torch

from vllm_ascend_chunk.config.settings import RemoteConfig
from vllm_ascend_chunk.core.geometry import PoolGeometry
from vllm_ascend_chunk.core.pool import ChunkCachePool
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata
from vllm_ascend_chunk.tiers.mooncake import worker as remote_worker
from vllm_ascend_chunk.tiers.mooncake.jobs import NAME, RemoteJobs, RemoteRead, RemoteWrite
from vllm_ascend_chunk.tiers.mooncake.kv_object import FORMAT_VERSION, KVHeader, SigningKey, encode
from vllm_ascend_chunk.tiers.mooncake.store_stats import RemoteStoreStats
from vllm_ascend_chunk.tiers.mooncake.worker import IDLE_WAIT_S, RemoteStoreWorker, ShardIdentity, object_name

RETRY_S = 0.1
CPU = torch.device("cpu")
GEOMETRY = PoolGeometry(
    num_layers=2, num_kv_heads=2, head_size=8, dtype=torch.float32, num_pages=4, page_size=4
)
IDENTITY = ShardIdentity(model="tiny-llama", layout="overlap", tp_rank=0, tp_size=1)
STEP = ChunkCacheStepMetadata()
"""A step in which requests compute (not idle) and the tier has nothing new to do."""
IDLE = ChunkCacheStepMetadata(idle=True)


def step(reads: list[RemoteRead] | None = None, writes: list[RemoteWrite] | None = None):
    """A step whose remote jobs are these `reads` and `writes`."""
    return ChunkCacheStepMetadata(tier_jobs={NAME: RemoteJobs(reads or [], writes or [])})


# -- a pool whose rows the tier reads and writes -----------------------------------------------


def _not_used(*args):
    raise AssertionError("the remote tier never loads or saves paged-cache slots")


def make_pool() -> ChunkCachePool:
    layers = GEOMETRY.num_layers
    return ChunkCachePool(GEOMETRY, [_not_used] * layers, [_not_used] * layers, CPU)


def fill(pool: ChunkCachePool, seed: int) -> None:
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(seed)))


# -- RemoteStoreWorker against a stand-in store -------------------------------------------------------


class StandInStore:
    """What `RemoteStoreWorker` uses of a `RemoteStore`; the tests settle the futures of its gets."""

    def __init__(self, timeout_s: float = 0.3) -> None:
        self.config = RemoteConfig(master="-", metadata_server="-", timeout_s=timeout_s)
        self.up = True
        self.counters = RemoteStoreStats()
        self.gets: list[tuple[str, KVHeader, concurrent.futures.Future]] = []
        self.puts: list[tuple[str, KVHeader, torch.Tensor]] = []
        self.closed = False
        self.signing_key = None

    def get(self, name: str, header: KVHeader) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.gets.append((name, header, future))
        return future

    def put(self, name: str, header: KVHeader, kv: torch.Tensor) -> None:
        self.puts.append((name, header, kv))

    def stats(self) -> RemoteStoreStats:
        return dataclasses.replace(self.counters)

    def close(self) -> None:
        self.closed = True


def stand_in_tier(
    timeout_s: float = 0.3, identity: ShardIdentity = IDENTITY
) -> tuple[RemoteStoreWorker, StandInStore]:
    store = StandInStore(timeout_s)
    tier = RemoteStoreWorker(store, GEOMETRY, identity)  # type: ignore[arg-type]
    tier.finish(STEP, make_pool())  # the first report (store up, counters): nothing new after it
    return tier, store


def reported_reads(tier: RemoteStoreWorker, pool: ChunkCachePool, timeout_s: float = 10.0) -> dict[int, bool]:
    """Idle steps until the tier reports reads (a real store's arrive in its reader threads):
    what it reported for its rank."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = tier.finish(IDLE, pool)
        if report is not None and report.reads:
            return report.reads
    raise AssertionError(f"no read reported within {timeout_s} s")


def kv_of(tier: RemoteStoreWorker, key: bytes, num_tokens: int, seed: int) -> torch.Tensor:
    h = tier.header(key, num_tokens)
    return torch.randn(h.shape, generator=torch.Generator().manual_seed(seed)).to(h.torch_dtype)


def test_each_shard_of_an_entry_has_its_own_object() -> None:
    key = bytes.fromhex("00ff10")
    shards = [(0, 1, 0, 1), (0, 2, 0, 1), (1, 2, 0, 1), (0, 4, 0, 1), (3, 4, 0, 1)]
    shards += [(0, 1, 0, 2), (0, 1, 1, 2), (1, 2, 1, 2)]  # pipeline stages
    names = {
        object_name(k, dataclasses.replace(IDENTITY, tp_rank=r, tp_size=s, pp_rank=p, pp_size=ps))
        for k in (key, b"other")
        for r, s, p, ps in shards
    }
    assert len(names) == 2 * len(shards)
    assert object_name(key, dataclasses.replace(IDENTITY, tp_rank=1, tp_size=2)) == (
        f"chunk-cache/v{FORMAT_VERSION}/00ff10/tp1of2"
    )
    assert object_name(key, dataclasses.replace(IDENTITY, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)) == (
        f"chunk-cache/v{FORMAT_VERSION}/00ff10/tp1of2-pp1of2"
    )


def test_what_else_must_match_is_in_the_header_not_the_name() -> None:
    """The key already covers model and layout: engines that differ only there would compute
    different keys. If they ever met under one name, the header makes it a miss."""
    other = dataclasses.replace(IDENTITY, model="other", layout="sequential")
    assert object_name(b"k", other) == object_name(b"k", IDENTITY)
    tier, _ = stand_in_tier()
    theirs = RemoteStoreWorker(StandInStore(), GEOMETRY, other)  # type: ignore[arg-type]
    assert tier.header(b"k", 5) != theirs.header(b"k", 5)
    h = tier.header(b"k", 5)
    assert (h.key, h.num_tokens, h.tp_rank, h.tp_size) == ("6b", 5, 0, 1)
    assert (h.num_layers, h.num_kv_heads, h.head_size, h.dtype) == (2, 2, 8, "torch.float32")
    assert (h.pp_rank, h.pp_size, h.key_id) == (0, 1, "")  # unsigned: the stand-in has no secret
    stage = RemoteStoreWorker(StandInStore(), GEOMETRY, dataclasses.replace(IDENTITY, pp_rank=1, pp_size=2))  # type: ignore[arg-type]
    assert (stage.header(b"k", 5).pp_rank, stage.header(b"k", 5).pp_size) == (1, 2)


def test_writes_send_a_copy_of_the_entrys_rows_under_its_shard_name() -> None:
    tier, store = stand_in_tier(identity=dataclasses.replace(IDENTITY, tp_rank=1, tp_size=2))
    pool = make_pool()
    fill(pool, seed=1)
    writes = [RemoteWrite(key=b"a", rows=[4, 5, 6]), RemoteWrite(key=b"b", rows=[15, 0])]
    tier.save(step(writes=writes), pool)
    for write, (name, h, kv) in zip(writes, store.puts, strict=True):
        assert name == object_name(write.key, tier.identity)
        assert h == tier.header(write.key, len(write.rows))
        assert torch.equal(kv, pool.kv[:, :, write.rows])
        encode(h, kv)  # what the store writes: the rows match their header
    expected = store.puts[0][2].clone()
    pool.kv.zero_()  # the rows are reused before the writer thread gets to the object
    assert torch.equal(store.puts[0][2], expected)


def test_reads_that_arrive_are_written_into_their_rows_and_reported() -> None:
    tier, store = stand_in_tier()
    pool = make_pool()
    reads = [RemoteRead(read_id=7, key=b"a", rows=[8, 9]), RemoteRead(read_id=8, key=b"b", rows=[1])]
    tier.start(step(reads=reads), pool)
    (name_a, header_a, got_a), (name_b, header_b, got_b) = store.gets
    assert (name_a, header_a) == (object_name(b"a", IDENTITY), tier.header(b"a", 2))
    assert (name_b, header_b) == (object_name(b"b", IDENTITY), tier.header(b"b", 1))
    kv = kv_of(tier, b"a", 2, seed=2)
    got_a.set_result(kv)
    got_b.set_result(None)  # a miss
    report = tier.finish(STEP, pool)
    assert report.reads == {7: True, 8: False}
    assert report.up is True and report.counters == dataclasses.asdict(store.counters)
    assert torch.equal(pool.kv[:, :, [8, 9]], kv)
    untouched = [r for r in range(GEOMETRY.num_rows) if r not in (8, 9)]
    assert not pool.kv[:, :, untouched].any()
    assert tier.finish(STEP, pool) is None, "a read was reported twice"


def test_a_step_never_waits_for_reads_they_end_when_they_arrive_or_at_their_deadline() -> None:
    timeout_s = 0.4
    tier, store = stand_in_tier(timeout_s)
    pool = make_pool()
    reads = [RemoteRead(read_id=i, key=bytes([i]), rows=[i]) for i in range(5)]
    tier.start(step(reads=reads), pool)
    store.gets[1][2].set_running_or_notify_cancel()  # a read under way: it cannot be cancelled
    first = kv_of(tier, b"\x03", 1, seed=3)
    store.gets[3][2].set_result(first)  # behind the stuck ones, arrived in the first step
    report = tier.finish(STEP, pool)
    assert report.reads == {3: True}, "a step waited for reads (it would report 0-2 as misses)"
    assert torch.equal(pool.kv[:, :, [3]], first)
    later = kv_of(tier, b"\x04", 1, seed=5)
    store.gets[4][2].set_result(later)  # arrives while a later step runs
    assert tier.finish(STEP, pool).reads == {4: True}
    time.sleep(timeout_s)
    assert tier.finish(STEP, pool).reads == {0: False, 1: False, 2: False}  # past the deadline
    assert store.gets[0][2].cancelled() and store.gets[2][2].cancelled()  # queued: skipped, no transfer
    # The read under way arrives after the tier gave up on it: its rows are not written.
    store.gets[1][2].set_result(kv_of(tier, b"\x01", 1, seed=4))
    assert tier.finish(STEP, pool) is None
    assert torch.equal(pool.kv[:, :, [4]], later)
    assert not pool.kv[:, :, :3].any()


def test_an_idle_step_waits_briefly_for_a_read_and_no_longer_than_its_deadline(monkeypatch) -> None:
    """How long each step may wait (the timeout it hands `concurrent.futures.wait`), not how long
    it took: only an idle step with reads out waits, at most `IDLE_WAIT_S` and never past their
    deadline, and a read that ends meanwhile is reported by that step."""
    waits: list[float] = []
    during_wait: list = []
    real_wait = concurrent.futures.wait

    def spy(fs, timeout=None, return_when=concurrent.futures.ALL_COMPLETED):
        waits.append(timeout)
        for settle in during_wait:
            settle()
        during_wait.clear()
        return real_wait(fs, timeout, return_when)

    monkeypatch.setattr(remote_worker.concurrent.futures, "wait", spy)
    tier, store = stand_in_tier(timeout_s=5.0)
    pool = make_pool()
    assert tier.finish(IDLE, pool) is None and waits == [], "no reads: no wait"
    tier.start(step(reads=[RemoteRead(read_id=1, key=b"a", rows=[0])]), pool)
    assert tier.finish(STEP, pool) is None and waits == [], "requests compute: no wait"
    assert tier.finish(IDLE, pool) is None and waits == [IDLE_WAIT_S]  # nothing arrived
    during_wait.append(lambda: store.gets[0][2].set_result(None))
    assert tier.finish(IDLE, pool).reads == {1: False}  # ended while the idle step waited
    short, store = stand_in_tier(timeout_s=0.0)
    short.start(step(reads=[RemoteRead(read_id=2, key=b"b", rows=[0])]), pool)
    assert short.finish(IDLE, pool).reads == {2: False}  # past its deadline
    assert waits[-1] == 0.0


def test_the_store_state_is_reported_when_it_changes() -> None:
    tier, store = stand_in_tier()
    pool = make_pool()
    assert tier.finish(STEP, pool) is None
    store.counters.absent += 1
    report = tier.finish(STEP, pool)
    assert report.reads == {} and report.counters["absent"] == 1 and report.up is True
    assert tier.finish(STEP, pool) is None
    store.up = False
    assert tier.finish(STEP, pool).up is False
    assert tier.finish(STEP, pool) is None
    store.up = True
    assert tier.finish(STEP, pool).up is True


def test_close_closes_the_store() -> None:
    tier, store = stand_in_tier()
    tier.close()
    assert store.closed


def test_an_unsigned_tier_starts_with_one_warning_that_the_store_is_trusted(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.chunk_cache"):
        stand_in_tier()
        stand_in_tier(identity=dataclasses.replace(IDENTITY, tp_rank=1, tp_size=2))  # only rank 0 warns
        signed = StandInStore()
        signed.signing_key = SigningKey(b"shared by every instance")
        RemoteStoreWorker(signed, GEOMETRY, IDENTITY)  # type: ignore[arg-type]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "not signed, so the store is trusted" in warning and "VLLM_CHUNK_CACHE_REMOTE_SECRET" in warning
