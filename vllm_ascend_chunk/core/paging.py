"""Page arithmetic shared by the chunk pool (pages of rows) and vLLM's paged KV cache (blocks),
and the page index shared by the pool and the host-memory tier.

Pure, no vLLM and no tensors: the pool index (`scheduler.manager`), the host tier's index
(`tiers.host.index`), the pool geometry and the scheduler's save and load slots all address
tokens the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages of `page_size` tokens needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def slot_of(pages: Sequence[int], page_size: int, token: int) -> int:
    """Flat index (pool row, or paged-cache slot) of the `token`-th token stored in `pages`."""
    return pages[token // page_size] * page_size + token % page_size


@dataclass(eq=False)
class PagedEntry:
    """The tokens of one key, stored in whole pages."""

    key: bytes
    num_tokens: int
    pages: list[int]

    def rows(self, page_size: int) -> list[int]:
        """Rows of the entry's tokens, in token order."""
        return [slot_of(self.pages, page_size, t) for t in range(self.num_tokens)]


E = TypeVar("E", bound=PagedEntry)


class PageIndex(Generic[E]):
    """Which key's entry holds which of `num_pages` pages of `page_size` rows, least recently used
    first, and the free pages (the last freed is handed out first)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self.entries: OrderedDict[bytes, E] = OrderedDict()  # least recently used first

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self.free_pages)

    @property
    def usage_ratio(self) -> float:
        return self.used_pages / self.num_pages if self.num_pages else 0.0

    def _lru_victims(self, candidates: Iterable[E], pages_needed: int) -> list[E] | None:
        """The first `candidates` (least recently used first) whose pages, with the free ones, add
        up to `pages_needed`, or None if all of them together hold fewer."""
        shortfall = pages_needed - len(self.free_pages)
        victims: list[E] = []
        remaining = iter(candidates)
        while shortfall > 0:
            victim = next(remaining, None)
            if victim is None:
                return None
            victims.append(victim)
            shortfall -= len(victim.pages)
        return victims

    def _take_pages(self, num_pages: int) -> list[int]:
        """`num_pages` free pages (the caller made room)."""
        return [self.free_pages.pop() for _ in range(num_pages)]

    def _give_back(self, entry: E) -> None:
        """Put the pages of `entry` back on the free list."""
        self.free_pages.extend(reversed(entry.pages))

    def _free(self, entry: E) -> None:
        """Take `entry` out of the index and give its pages back."""
        del self.entries[entry.key]
        self._give_back(entry)
