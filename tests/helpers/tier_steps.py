"""The package's tiers as tests that play the workers see them: the host and remote tiers' jobs
in a step's metadata, a remote report, the coordinator's remote tier, settings that enable it."""

from __future__ import annotations

import dataclasses

from vllm_ascend_chunk.config.settings import ChunkCacheConfig, RemoteConfig
from vllm_ascend_chunk.core.step import ChunkCacheStepMetadata, ChunkCacheWorkerMetadata
from vllm_ascend_chunk.tiers.host.scheduler import NAME as HOST
from vllm_ascend_chunk.tiers.host.scheduler import HostJobs
from vllm_ascend_chunk.tiers.mooncake.jobs import NAME as REMOTE
from vllm_ascend_chunk.tiers.mooncake.jobs import RemoteJobs, RemoteReport
from vllm_ascend_chunk.tiers.mooncake.scheduler import RemoteStoreTier


def with_remote(settings: ChunkCacheConfig) -> ChunkCacheConfig:
    """`settings` with a remote store (the scheduler side never connects to it)."""
    return dataclasses.replace(settings, remote_config=RemoteConfig(master="-", metadata_server="-"))


def host_jobs(meta: ChunkCacheStepMetadata) -> HostJobs:
    return meta.tier_jobs.get(HOST) or HostJobs()


def remote_jobs(meta: ChunkCacheStepMetadata) -> RemoteJobs:
    return meta.tier_jobs.get(REMOTE) or RemoteJobs()


def remote_report(
    reads: dict[int, dict[int, bool]] | None = None,
    up: dict[int, bool] | None = None,
    counters: dict[int, dict[str, int]] | None = None,
) -> ChunkCacheWorkerMetadata:
    """The workers' report of the remote tier: by rank, the reads ended, the store's state, its
    counters."""
    reads, up, counters = reads or {}, up or {}, counters or {}
    return ChunkCacheWorkerMetadata(
        tiers={
            REMOTE: {
                rank: RemoteReport(reads=reads.get(rank, {}), up=up.get(rank), counters=counters.get(rank))
                for rank in {*reads, *up, *counters}
            }
        }
    )


def remote_tier(coord) -> RemoteStoreTier | None:
    """The coordinator's remote tier (None: it has none)."""
    return coord.manager.tier(REMOTE)


def take_host_jobs(manager) -> HostJobs:
    """The host tier's jobs of the step being built (`ChunkCacheManager.take_jobs`)."""
    return manager.take_jobs().get(HOST) or HostJobs()
