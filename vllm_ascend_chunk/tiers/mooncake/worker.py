"""RemoteTier: one worker's side of the shared remote store (`tiers.worker_base.WorkerTier`) — names,
headers, reads in flight.

Each worker stores its own shard of an entry (its tensor-parallel heads of its pipeline stage's
layers) as one object named after the entry's key and the shard (`object_name`); the key already
covers model, dtypes, LoRA, `cache_salt` and the parallel sizes, and the header
(`kv_object.KVHeader`) is checked on every read, so an object of another model, format or shard
is a miss, never wrong KV; with a secret, so is an object its key did not sign. Writes are
queued: the step copies the entry's rows to host memory, the store's writer thread writes them.
Reads start with the step that asks for them and run while its forward does; at its end `finish`
waits for them, up to the timeout: an entry is written into its pool rows only if its object
arrived whole by then.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass

from vllm_ascend_chunk.core.geometry import PoolGeometry
from vllm_ascend_chunk.core.pool import ChunkCachePool
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata, ChunkCacheWorkerMetadata, RemoteRead
from vllm_ascend_chunk.tiers.mooncake.kv_object import FORMAT_VERSION, KVHeader
from vllm_ascend_chunk.tiers.mooncake.store import RemoteStore

logger = logging.getLogger("vllm.chunk_cache")


@dataclass(frozen=True)
class ShardIdentity:
    """What besides the key an object must match to be loaded by this worker."""

    model: str
    layout: str
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def rank(self) -> int:
        """The worker's rank in its engine (pipeline stage major, as vLLM orders them)."""
        return self.pp_rank * self.tp_size + self.tp_rank


def object_name(key: bytes, identity: ShardIdentity) -> str:
    shard = f"tp{identity.tp_rank}of{identity.tp_size}"
    if identity.pp_size > 1:  # (names without a stage stay those of earlier releases)
        shard += f"-pp{identity.pp_rank}of{identity.pp_size}"
    return f"chunk-cache/v{FORMAT_VERSION}/{key.hex()}/{shard}"


class RemoteTier:
    def __init__(self, store: RemoteStore, geometry: PoolGeometry, identity: ShardIdentity) -> None:
        self.store = store
        self.geometry = geometry
        self.identity = identity
        self._reads: list[tuple[RemoteRead, concurrent.futures.Future]] = []
        self._reported_up: bool | None = None
        self._reported_counters: dict[str, int] | None = None
        if store.signing_key is None and identity.rank == 0:
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
        """Start the step's reads (they run while its forward does)."""
        for read in meta.remote_reads:
            name = object_name(read.key, self.identity)
            self._reads.append((read, self.store.get(name, self.header(read.key, len(read.rows)))))

    def save(self, meta: ChunkCacheStepMetadata, pool: ChunkCachePool) -> None:
        """Queue the step's writes (entries whose last tokens it saved)."""
        for write in meta.remote_writes:
            kv = pool.read_rows(write.rows)
            self.store.put(object_name(write.key, self.identity), self.header(write.key, len(write.rows)), kv)

    def finish(self, pool: ChunkCachePool) -> ChunkCacheWorkerMetadata | None:
        """Wait (up to the timeout) for the reads started this step, write the objects that came
        into their rows, and report them; None when there is nothing new to report."""
        deadline = time.monotonic() + self.store.config.timeout_s
        reads: dict[int, bool] = {}
        for read, future in self._reads:
            try:
                kv = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                future.cancel()  # a read still queued: skipped, no transfer
                kv = None
            if kv is not None:
                pool.write_rows(read.rows, kv)
            reads[read.read_id] = kv is not None
        self._reads = []
        up = self.store.up
        counters = dataclasses.asdict(self.store.stats())
        if not reads and up == self._reported_up and counters == self._reported_counters:
            return None
        self._reported_up, self._reported_counters = up, counters
        return ChunkCacheWorkerMetadata(
            reads=reads,
            remote_up={self.identity.rank: up},
            remote_counters={self.identity.rank: counters},
        )

    def close(self) -> None:
        self.store.close()
