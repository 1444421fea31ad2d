"""`core.paging`'s page arithmetic against slots worked out by hand: the other tests (the
coordinator's, the selection's, the async scheduler's) use `slot_of` as their oracle, so it is
checked here against numbers that do not come from it."""

from __future__ import annotations

import pytest

from vllm_ascend_chunk.core.paging import PagedEntry, pages_for, slot_of

PAGES = [3, 0, 7]
"""An entry's pages, out of order (as the free list hands them out), 4 tokens a page."""


@pytest.mark.parametrize(
    "token, slot",
    [
        (0, 12),  # page 3 starts at row 3 * 4
        (3, 15),  # its last row
        (4, 0),  # the second page is page 0
        (7, 3),
        (8, 28),  # page 7 starts at row 7 * 4
        (10, 30),
    ],
)
def test_slot_of_a_token_is_its_page_s_first_row_plus_its_offset(token, slot):
    assert slot_of(PAGES, 4, token) == slot


def test_slot_of_a_token_past_the_pages_is_an_error():
    with pytest.raises(IndexError):
        slot_of(PAGES, 4, 12)


def test_an_entry_s_rows_are_its_tokens_slots_in_order():
    entry = PagedEntry(b"k", num_tokens=10, pages=PAGES)
    assert entry.rows(4) == [12, 13, 14, 15, 0, 1, 2, 3, 28, 29]
    assert PagedEntry(b"k", 5, [2, 1]).rows(16) == [32, 33, 34, 35, 36]  # one page, partly used


@pytest.mark.parametrize("tokens, pages", [(0, 0), (1, 1), (4, 1), (5, 2), (12, 3), (13, 4)])
def test_pages_for_rounds_up(tokens, pages):
    assert pages_for(tokens, 4) == pages
