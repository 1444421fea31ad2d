"""The tier backends an engine may use, in the order a missing key is offered to them, and the
factory that builds an engine's tiers from its settings (`build_tiers` on the scheduler's side,
`build_worker_tiers` on each worker's). A backend is a folder of `tiers/` with a `Backend`; one
line in `BACKENDS` registers it (`tiers.base.Backend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_ascend_chunk.tiers.base import Backend
from vllm_ascend_chunk.tiers.host.backend import BACKEND as HOST
from vllm_ascend_chunk.tiers.mooncake.backend import BACKEND as MOONCAKE

if TYPE_CHECKING:
    import torch

    from vllm_ascend_chunk.config.settings import ChunkCacheConfig
    from vllm_ascend_chunk.core.geometry import PoolGeometry
    from vllm_ascend_chunk.tiers.base import TierOwner
    from vllm_ascend_chunk.tiers.worker_base import WorkerTier


BACKENDS: list[Backend] = [HOST, MOONCAKE]
"""Every backend, in the order a key missing from the pool is offered to them."""


def build_tiers(settings: ChunkCacheConfig, geometry: PoolGeometry, owner: TierOwner, ranks: int) -> None:
    """The scheduler sides of the tiers `settings` ask for, added to `owner` in `BACKENDS` order."""
    for backend in BACKENDS:
        if (tier := backend.scheduler(settings, geometry, owner, ranks)) is not None:
            owner.add_tier(tier)


def build_worker_tiers(
    settings: ChunkCacheConfig, vllm_config: Any, geometry: PoolGeometry, device: torch.device
) -> list[WorkerTier]:
    """The workers' sides of the tiers `settings` ask for, in `BACKENDS` order."""
    built = (backend.worker(settings, vllm_config, geometry, device) for backend in BACKENDS)
    return [tier for tier in built if tier is not None]


def tier_gauges() -> dict[str, str]:
    """Every backend's gauges → help text."""
    return {name: doc for backend in BACKENDS for name, doc in backend.gauges.items()}
