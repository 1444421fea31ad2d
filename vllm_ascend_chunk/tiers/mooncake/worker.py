"""RemoteStoreWorker: one worker's side of the shared remote store (`tiers.worker_base.WorkerTier`):
names, headers, reads in flight.

Each worker stores its own shard of an entry (its tensor-parallel heads of its pipeline stage's
layers) as one object named after the entry's key and the shard (`object_name`); the key already
covers model, dtypes, LoRA, `cache_salt` and the parallel sizes, and the header
(`kv_object.KVHeader`) is checked on every read, so an object of another model, format or shard
is a miss, never wrong KV; with a secret, so is an object its key did not sign. Writes are
queued: the step copies the entry's rows to host memory, the store's writer thread writes them.
Reads start with the step that asks for them and run in the store's reader threads while this and
later steps run: no step waits for them. At each step's end `finish` writes the objects that
arrived whole into their pool rows and reports them; a read not done within the timeout of its
start is given up (a miss: the entry is computed). Only a step in which no request computes
(`ChunkCacheStepMetadata.idle`: every request waits) waits, at most `IDLE_WAIT_S`, for one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass

from vllm_ascend_chunk.core.geometry import PoolGeometry
from vllm_ascend_chunk.core.pool import ChunkCachePool
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata
from vllm_ascend_chunk.tiers.mooncake.jobs import NAME, RemoteJobs, RemoteRead, RemoteReport
from vllm_ascend_chunk.tiers.mooncake.kv_object import FORMAT_VERSION, KVHeader
from vllm_ascend_chunk.tiers.mooncake.store import RemoteStore
from vllm_ascend_chunk.tiers.worker_base import jobs_of

logger = logging.getLogger("vllm.chunk_cache")

IDLE_WAIT_S = 0.01
"""How long an idle step (`ChunkCacheStepMetadata.idle`) waits for a read to end: the engine
steps again at once otherwise, and a new request waits for the step no longer than this."""


@dataclass(frozen=True)
class ShardIdentity:
    """What besides the key an object must match to be loaded by this worker."""

    model: str
    layout: str
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1


@dataclass
class _PendingRead:
    read: RemoteRead
    future: concurrent.futures.Future
    deadline: float
    """Given up (a miss) if not done by then: the timeout after the step that started it."""


def object_name(key: bytes, identity: ShardIdentity) -> str:
    shard = f"tp{identity.tp_rank}of{identity.tp_size}"
    if identity.pp_size > 1:  # (names without a stage stay those of earlier releases)
        shard += f"-pp{identity.pp_rank}of{identity.pp_size}"
    return f"chunk-cache/v{FORMAT_VERSION}/{key.hex()}/{shard}"


class RemoteStoreWorker:
    name = NAME

    def __init__(self, store: RemoteStore, geometry: PoolGeometry, identity: ShardIdentity) -> None:
        self.store = store
        self.geometry = geometry
        self.identity = identity
        self._reads: list[_PendingRead] = []
        """Reads started and not reported yet, in the order they started."""
        self._reported_up: bool | None = None
        self._reported_counters: dict[str, int] | None = None
        if store.signing_key is None and identity.tp_rank == identity.pp_rank == 0:
            logger.warning(
                "Chunk Cache remote store %s: objects are not signed, so the store is trusted: any "
                "process that can write to it can make this instance serve K/V of its choice. Set "
                "VLLM_CHUNK_CACHE_REMOTE_SECRET (or _SECRET_FILE) on every instance to sign and "
                "verify them (docs/operator/tiers.md)",
                store.config.master,
            )

    def header(self, key: bytes, num_tokens: int) -> KVHeader:
        g, ident = self.geometry, self.identity
        return KVHeader(
            key=key.hex(),
            model=ident.model,
            dtype=str(g.dtype),
            layout=ident.layout,
            num_tokens=num_tokens,
            num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads,
            head_size=g.head_size,
            tp_rank=ident.tp_rank,
            tp_size=ident.tp_size,
            pp_rank=ident.pp_rank,
            pp_size=ident.pp_size,
            key_id=self.store.signing_key.id if self.store.signing_key is not None else "",
        )

    def start(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        """Start the step's reads (they run while this and later steps do)."""
        jobs: RemoteJobs | None = jobs_of(self, meta)
        if jobs is None:
            return
        deadline = time.monotonic() + self.store.config.timeout_s
        for read in jobs.reads:
            name = object_name(read.key, self.identity)
            future = self.store.get(name, self.header(read.key, len(read.rows)))
            self._reads.append(_PendingRead(read, future, deadline))

    def save(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        """Queue the step's writes (entries whose last tokens it saved)."""
        jobs: RemoteJobs | None = jobs_of(self, meta)
        for write in jobs.writes if jobs is not None else ():
            kv = pool.read_rows(write.rows)
            self.store.put(object_name(write.key, self.identity), self.header(write.key, len(write.rows)), kv)

    def finish(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> RemoteReport | None:
        """Write the objects that arrived since the last step into their rows, give up the reads
        past their deadline, and report both; None when there is nothing new to report. Waits
        only in an idle step, at most `IDLE_WAIT_S`, for a read to end."""
        if meta.idle and self._reads:
            wait = min(IDLE_WAIT_S, self._reads[0].deadline - time.monotonic())
            concurrent.futures.wait(
                [p.future for p in self._reads], max(0.0, wait), concurrent.futures.FIRST_COMPLETED
            )
        now = time.monotonic()
        reads: dict[int, bool] = {}
        pending = []
        for p in self._reads:
            if p.future.done():
                kv = p.future.result()
            elif now >= p.deadline:
                p.future.cancel()  # a read still queued: skipped, no transfer
                kv = None
            else:
                pending.append(p)
                continue
            if kv is not None:
                pool.write_rows(p.read.rows, kv)
            reads[p.read.read_id] = kv is not None
        self._reads = pending
        up = self.store.up
        counters = dataclasses.asdict(self.store.stats())
        if not reads and up == self._reported_up and counters == self._reported_counters:
            return None
        self._reported_up, self._reported_counters = up, counters
        return RemoteReport(reads=reads, up=up, counters=counters)

    def close(self) -> None:
        self.store.close()
