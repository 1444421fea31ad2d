"""The test-only memory tier's `Backend`, and its registration for the length of a test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tests.helpers.memory_tier.scheduler import NAME, MemoryTier
from tests.helpers.memory_tier.worker import MemoryCopies
from vllm_ascend_chunk.tiers import registry
from vllm_ascend_chunk.tiers.base import Backend

MEMORY = Backend(
    NAME,
    lambda settings, geometry, owner, ranks: MemoryTier(owner, ranks),
    lambda settings, vllm_config, geometry, device: MemoryCopies(),
    gauges={"memory_entries": "Entries in the test-only memory tier."},
)


@contextlib.contextmanager
def registered(backend: Backend = MEMORY) -> Iterator[None]:
    """`backend` registered (after the package's) for engines built meanwhile in this process:
    the one line a backend of the package adds to `tiers.registry.BACKENDS`."""
    registry.BACKENDS.append(backend)
    try:
        yield
    finally:
        registry.BACKENDS.remove(backend)
