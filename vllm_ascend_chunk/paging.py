"""Page arithmetic shared by the chunk pool (pages of rows) and vLLM's paged KV cache (blocks).

Pure functions, no vLLM and no tensors: the pool index (`scheduler.manager`), the pool geometry
and the scheduler's save and load slots all address tokens the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages of `page_size` tokens needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def slot_of(pages: Sequence[int], page_size: int, token: int) -> int:
    """Flat index (pool row, or paged-cache slot) of the `token`-th token stored in `pages`."""
    return pages[token // page_size] * page_size + token % page_size


class _Paged(Protocol):
    pages: list[int]


P = TypeVar("P", bound=_Paged)


def lru_victims(candidates: Iterable[P], pages_needed: int) -> list[P] | None:
    """The first `candidates` (least recently used first) whose pages add up to `pages_needed`,
    or None if all of them together hold fewer."""
    victims, freed = [], 0
    for candidate in candidates:
        if freed >= pages_needed:
            break
        victims.append(candidate)
        freed += len(candidate.pages)
    return victims if freed >= pages_needed else None
