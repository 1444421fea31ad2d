"""The host-memory tier's `Backend`: on when the engine's geometry has host pages
(`VLLM_CHUNK_CACHE_HOST_GB`)."""

from __future__ import annotations

from vllm_ascend_chunk.tiers.base import Backend
from vllm_ascend_chunk.tiers.host.scheduler import NAME, HostTier


def _scheduler(settings, geometry, owner, ranks) -> HostTier | None:
    if not geometry.num_host_pages:
        return None
    return HostTier(geometry.num_host_pages, geometry.page_size, owner.stats, geometry.bytes_per_token)


def _worker(settings, vllm_config, geometry, device):
    if not geometry.num_host_pages:
        return None
    from vllm_ascend_chunk.tiers.host.worker import HostCopies

    return HostCopies(geometry, device)


BACKEND = Backend(
    NAME,
    _scheduler,
    _worker,
    gauges={
        "host_usage_ratio": "Fraction of the host-memory tier's pages in use (0..1; 0 without one).",
        "host_entries": "Entries in the host-memory tier.",
    },
)
