"""A third tier backend, for tests only: one folder (`scheduler.py`, `worker.py`, `backend.py`)
and one registration (`registered`), to show that a backend needs no edit to the package. It keeps
the K/V of evicted entries in a dict on each worker, and fills a missing entry asynchronously
(`Fill.LATER`): its workers copy the rows at the end of the step that carries the fill, and their
reports end it (or a unit test ends it, `MemoryTier.finish`, where there are no workers)."""

from tests.helpers.memory_tier.backend import MEMORY, registered
from tests.helpers.memory_tier.scheduler import MemoryTier

__all__ = ["MEMORY", "MemoryTier", "registered"]
