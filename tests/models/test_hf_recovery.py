"""The HF plan forms of recovery modes (`tests/helpers/hf_recovery.py`) against the references
(`tests/helpers/hf_reference.py`) on tiny-llama."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import hf_recovery as hr
from tests.helpers.hf_reference import greedy, load


@pytest.fixture(scope="module")
def tiny(models_dir):
    return load(models_dir / "tiny-llama")


PROMPT, SYS, LENS = list(range(5, 60)), 7, [10, 17, 8]


@pytest.mark.parametrize("layout", ["overlap", "sequential"])
def test_plain_plan_equals_the_layout_reference(tiny, layout):
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    out = hr.run(tiny, PROMPT, SYS, LENS, layout, set(), kv, max_tokens=6)
    assert out.tokens == greedy(tiny, PROMPT, 6, SYS, LENS, layout).tokens
    assert out.computed == len(PROMPT) - SYS - sum(LENS)


def test_suffix_last_plan_equals_the_reference_with_the_last_chunk_in_the_question(tiny):
    """In `sequential`, the engine's `last` recovery mode has two independent forms: the plan that
    computes C_n's tokens attending to everything before them, and the reference whose question
    segment starts at C_n (`chunk_cases.reference(..., recovery="last")`). In `overlap` they differ
    by positions: the plan keeps C_n at SYS's end, the engine places C_n after the longest of
    C_1..C_{n-1}, as it places a question."""
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    last = hr.recompute_set("suffix:last", SYS, LENS)
    out = hr.run(tiny, PROMPT, SYS, LENS, "sequential", last, kv, max_tokens=6)
    assert out.tokens == greedy(tiny, PROMPT, 6, SYS, LENS[:-1], "sequential").tokens


@pytest.mark.parametrize("mode", ["full", f"suffix:{sum(LENS)}", f"epic:{max(LENS)}"])
def test_plans_that_compute_everything_but_the_first_chunk_equal_full_attention(tiny, mode):
    """In `sequential`, C_1's cached KV is full attention's; computing the rest gives full attention."""
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    full, _ = hr.run_full(tiny, PROMPT, max_tokens=6)
    out = hr.run(tiny, PROMPT, SYS, LENS, "sequential", hr.recompute_set(mode, SYS, LENS), kv, max_tokens=6)
    assert full.tokens == greedy(tiny, PROMPT, 6).tokens
    assert out.tokens == full.tokens
    assert hr.kl(full.first_logprobs, out.first_logprobs) < 1e-6


def test_deferred_plans(tiny):
    """Deferring nothing changes nothing; deferring the whole region computes it in prompt order."""
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)

    def run(compute, defer):
        return hr.run(tiny, PROMPT, SYS, LENS, "sequential", compute, kv, 6, defer=defer).tokens

    assert run(set(), True) == run(set(), False)
    full, _ = hr.run_full(tiny, PROMPT, max_tokens=6)
    assert run(hr.recompute_set("defer-full", SYS, LENS), True) == full.tokens
    assert hr.recompute_set("defer-epic:3", SYS, LENS) == hr.recompute_set("epic:3", SYS, LENS)


def test_recompute_sets():
    region = sum(LENS)
    assert hr.recompute_set("plain", SYS, LENS) == set()
    assert hr.recompute_set("suffix:5", SYS, LENS) == set(range(region - 5, region))
    assert hr.recompute_set("suffix:last", SYS, LENS) == set(range(region - LENS[-1], region))
    assert hr.recompute_set("epic:3", SYS, LENS) == {10, 11, 12, 27, 28, 29}
    assert hr.recompute_set("blend:0.1", SYS, LENS, torch.arange(region).float()) == {32, 33, 34, 31}
    with pytest.raises(ValueError):
        hr.recompute_set("blend:0.1", SYS, LENS)
    assert hr.layout_starts(SYS, LENS, "overlap") == ([7, 7, 7], 24)
    assert hr.layout_starts(SYS, LENS, "sequential") == ([7, 17, 34], 42)
