"""Page arithmetic shared by the chunk pool (pages of rows) and vLLM's paged KV cache (blocks).

Pure functions, no vLLM and no tensors: the pool index (`scheduler.manager`), the pool geometry
and the scheduler's save and load slots all address tokens the same way.
"""

from __future__ import annotations

from collections.abc import Sequence


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages of `page_size` tokens needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def slot_of(pages: Sequence[int], page_size: int, token: int) -> int:
    """Flat index (pool row, or paged-cache slot) of the `token`-th token stored in `pages`."""
    return pages[token // page_size] * page_size + token % page_size
