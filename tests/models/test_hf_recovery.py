"""The HF plan forms of recovery modes (`harness/hf_recovery.py`) against the references
(`harness/hf_reference.py`) on tiny-llama."""

from __future__ import annotations

import pytest
import torch

from harness import hf_recovery as hr
from harness.hf_reference import greedy, load


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


SCATTERED = {0, 3, 11, 12, 20, 26, 27, 28, 33}


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("compute", [set(), SCATTERED, set(range(10, 13)) | set(range(27, 30))])
def test_one_pass_plans_equal_the_loop(tiny, compute, defer):
    """One masked forward of the computed tokens equals the plan executed run by run."""
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    loop = hr.run(tiny, PROMPT, SYS, LENS, "sequential", compute, kv, 6, defer=defer)
    one = hr.run(tiny, PROMPT, SYS, LENS, "sequential", compute, kv, 6, defer=defer, one_pass=True)
    assert one.tokens == loop.tokens
    assert one.computed == loop.computed
    assert hr.kl(loop.first_logprobs, one.first_logprobs) < 1e-6


def test_deferred_scattered_plan_loads_each_token_once(tiny):
    """A deferred scattered set loads only the tokens it does not compute: deferring a set whose
    tokens would all come last anyway (a suffix of the region) changes nothing."""
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    suffix = hr.recompute_set("suffix:5", SYS, LENS)
    a = hr.run(tiny, PROMPT, SYS, LENS, "sequential", suffix, kv, 6)
    b = hr.run(tiny, PROMPT, SYS, LENS, "sequential", suffix, kv, 6, defer=True)
    assert a.tokens == b.tokens
    assert hr.kl(a.first_logprobs, b.first_logprobs) < 1e-6


@pytest.mark.parametrize("name", ["blend", "qattn", "epicr"])
def test_budgeted_modes_span_plain_to_full(tiny, name):
    """At budget 0 a budgeted mode is `plain`; at budget 1.0 it is full attention (sequential)."""
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    full, full_keys = hr.run_full(tiny, PROMPT, max_tokens=6)
    deviation = hr.key_deviation(tiny, kv, full_keys, SYS, LENS, "sequential")
    attention = hr.question_attention(
        tiny, PROMPT, SYS, LENS, "sequential", kv, hr.qattn_layer(tiny, "qattn:0")
    )
    plain = hr.run(tiny, PROMPT, SYS, LENS, "sequential", set(), kv, 6)

    def run(budget):
        compute = hr.recompute_set(f"{name}:{budget}", SYS, LENS, deviation, attention)
        return compute, hr.run(tiny, PROMPT, SYS, LENS, "sequential", compute, kv, 6, one_pass=True)

    none, out0 = run(0)
    assert none == set() and out0.tokens == plain.tokens
    everything, out1 = run(1.0)
    assert set(range(LENS[0], sum(LENS))) <= everything
    assert out1.tokens == full.tokens
    assert hr.kl(full.first_logprobs, out1.first_logprobs) < 1e-5
    some, _ = run(0.2)
    assert abs(len(some) - round(0.2 * sum(LENS))) <= (len(LENS) - 1 if name == "epicr" else 0)


def test_question_attention_and_qattn_selection(tiny):
    """The question's attention is a distribution share per region token; `qattn` takes the top
    tokens of C_2..C_n (never C_1, whose cached KV is exact) and reads the middle layer by default."""
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    layer = hr.qattn_layer(tiny, "qattn:0.1")
    assert layer == tiny.config.num_hidden_layers // 2
    assert hr.qattn_layer(tiny, "qattn:0.1@0") == 0
    attention = hr.question_attention(tiny, PROMPT, SYS, LENS, "sequential", kv, layer)
    q_len = len(PROMPT) - SYS - sum(LENS)
    heads = tiny.config.num_attention_heads
    assert attention.shape == (sum(LENS),)
    assert 0 < float(attention.sum()) <= heads * q_len + 1e-4
    scores = torch.arange(sum(LENS)).float().flip(0)  # C_1's tokens score highest
    assert hr.recompute_set("qattn:0.1", SYS, LENS, attention=scores) == {10, 11, 12, 13}
    with pytest.raises(ValueError):
        hr.recompute_set("qattn:0.1", SYS, LENS)


def test_qattn_refinements(tiny):
    """Issue 35's candidate rules: scores summed over layers, sink heads, a per-chunk floor, and
    windows grown by score mass (C_1 = 0..9, C_2 = 10..26, C_3 = 27..34; count 7 at 0.2)."""
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    assert hr.qattn_layer(tiny, "qattn:0.1/16@0+1,sink:4") == (0, 1)
    assert hr.qattn_layer(tiny, "qattn:0.1/4@1,grow") == 1
    summed = hr.question_attention(tiny, PROMPT, SYS, LENS, "sequential", kv, (0, 1))
    each = [hr.question_attention(tiny, PROMPT, SYS, LENS, "sequential", kv, layer) for layer in (0, 1)]
    torch.testing.assert_close(summed, each[0] + each[1])
    scores = torch.zeros(sum(LENS))
    scores[[19, 20, 21]] = torch.tensor([3.0, 5.0, 4.0])
    assert hr.recompute_set("qattn:0.2/2", SYS, LENS, attention=scores) == {*range(10, 14), *range(18, 22)}
    assert hr.recompute_set("qattn:0.2/2,floor", SYS, LENS, attention=scores) == {
        *range(18, 22),
        *range(30, 34),
    }
    assert hr.recompute_set("qattn:0.2/2,sink:2", SYS, LENS, attention=scores) == {
        10,
        11,
        27,
        28,
        *range(18, 22),
    }
    assert hr.recompute_set("qattn:0.2/1,grow", SYS, LENS, attention=scores) == set(range(15, 22))
    scores[30] = 1.0
    assert hr.recompute_set("qattn:0.2/2,grow", SYS, LENS, attention=scores) == {*range(16, 22), 30}
    for bad in ("qattn:0.2,sink:2", "qattn:0.2/2,nope"):
        with pytest.raises(ValueError):
            hr.recompute_set(bad, SYS, LENS, attention=scores)


def test_two_stage_selection():
    """`,two-stage`: `qattn:r/m`'s grid (count 7 in 2 windows of 4 from C_2's first token, offset
    10), the better half by the first scores, then the rest by the scores over the cache with that
    half computed, among the windows not chosen yet."""
    first = torch.zeros(sum(LENS))
    first[[19, 20, 21]] = torch.tensor([3.0, 5.0, 4.0])
    second = torch.zeros(sum(LENS))
    second[18:22] = 9.0  # already chosen: not chosen again
    second[30:34] = 1.0
    asked = []

    def rescore(chosen: set[int]) -> torch.Tensor:
        asked.append(chosen)
        return second

    got = hr.recompute_set("qattn:0.2/2,two-stage", SYS, LENS, attention=first, rescore=rescore)
    assert got == {*range(18, 22), *range(30, 34)}
    assert asked == [set(range(18, 22))]
    assert len(got) == len(hr.recompute_set("qattn:0.2/2", SYS, LENS, attention=first))
    asked.clear()  # one window in all: no second stage
    assert hr.recompute_set("qattn:0.2/1,two-stage", SYS, LENS, attention=first, rescore=rescore) == set(
        range(17, 24)
    )
    assert asked == []
    for bad, kwargs in (
        ("qattn:0.2/2,two-stage", {}),
        ("qattn:0.2/2,two-stage,floor", {"rescore": rescore}),
    ):
        with pytest.raises(ValueError):
            hr.recompute_set(bad, SYS, LENS, attention=first, **kwargs)


def test_question_attention_over_a_partly_recomputed_cache(tiny):
    """With every token after C_1 computed (C_1's cached KV is exact), the question's attention over
    the plan's cache is its attention in one causal forward of the whole prompt (sequential
    positions are the prompt's); with part of them computed it is neither that nor plain's."""
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    region, layer = sum(LENS), 1
    weights = []
    with torch.no_grad(), hr._attention(tiny, record=((layer,), weights)):
        tiny(input_ids=torch.tensor([PROMPT]))
    q_rows = slice(SYS + region, len(PROMPT) - 1)
    full = weights[0][0, :, q_rows, SYS : SYS + region].sum(dim=(0, 1))
    rest = set(range(LENS[0], region))
    got = hr.question_attention(tiny, PROMPT, SYS, LENS, "sequential", kv, layer, True, compute=rest)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-4)
    plain = hr.question_attention(tiny, PROMPT, SYS, LENS, "sequential", kv, layer, True)
    assert not torch.allclose(plain, full, atol=1e-3)
    half = hr.question_attention(
        tiny, PROMPT, SYS, LENS, "sequential", kv, layer, True, compute=set(range(LENS[0], 20))
    )
    assert not torch.allclose(half, plain, atol=1e-3) and not torch.allclose(half, full, atol=1e-3)


def test_whole_document_sets():
    """`chunks:` names chunks; `qdoc:k` takes the k chunks after C_1 of most question attention."""
    assert hr.recompute_set("chunks:1", SYS, LENS) == set(range(10, 27))
    assert hr.recompute_set("chunks:0+2", SYS, LENS) == {*range(10), *range(27, 35)}
    scores = torch.zeros(sum(LENS))
    scores[:10] = 5.0  # C_1 is exact already: never chosen
    scores[30] = 1.0  # C_3 holds more mass than C_2
    assert hr.recompute_set("qdoc:1", SYS, LENS, attention=scores) == set(range(27, 35))
    assert hr.recompute_set("qdoc:2", SYS, LENS, attention=scores) == set(range(10, 35))
    assert hr.recompute_set("qdoc:1", SYS, LENS, attention=torch.zeros(35)) == set(range(10, 27))
    with pytest.raises(ValueError, match="qdoc needs"):
        hr.recompute_set("qdoc:1", SYS, LENS)


def test_budgeted_sets():
    region = sum(LENS)
    assert hr.recompute_set("epicr:0.2", SYS, LENS) == {10, 11, 12, 13, 27, 28, 29, 30}  # k = round(7/2)
    assert hr.recompute_set("suffix:last:1", SYS, LENS) == hr.recompute_set("suffix:last", SYS, LENS)
    assert hr.recompute_set("suffix:last:2", SYS, LENS) == set(range(LENS[0], region))
    assert hr.recompute_set("ape:0.9,0.8", SYS, LENS) == set()
    assert hr.ape_setting("ape:0.9,0.8") == (0.9, 0.8)
    assert hr.ape_setting("blend:0.1") is None


def test_ape_scaling(tiny):
    """`ape:1,1` is plain reuse exactly; a scaled setting moves the first token's distribution, and
    the grouped form equals APE's: region weights softmax(l / T) inside, exp(T lse(l / T) + log S)
    as a group against the other columns."""
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    plain = hr.run(tiny, PROMPT, SYS, LENS, "sequential", set(), kv, 6)
    same = hr.run(tiny, PROMPT, SYS, LENS, "sequential", set(), kv, 6, ape=(1.0, 1.0))
    assert same.tokens == plain.tokens
    assert hr.kl(plain.first_logprobs, same.first_logprobs) < 1e-9
    moved = hr.run(tiny, PROMPT, SYS, LENS, "sequential", set(), kv, 6, ape=(0.5, 0.5))
    assert hr.kl(plain.first_logprobs, moved.first_logprobs) > 1e-6

    t, s = 0.7, 0.6
    logits = torch.randn(2, 12)
    region = slice(3, 9)
    doc = logits[:, region] / t
    merged = logits.clone()
    merged[:, region] = doc + (t - 1) * torch.logsumexp(doc, -1, keepdim=True) + torch.log(torch.tensor(s))
    weights = torch.softmax(merged, -1)
    groups = torch.stack(
        [
            torch.logsumexp(torch.cat([logits[:, :3], logits[:, 9:]], -1), -1),
            t * torch.logsumexp(doc, -1) + torch.log(torch.tensor(s)),
        ],
        -1,
    ).softmax(-1)
    assert torch.allclose(weights[:, region].sum(-1), groups[:, 1], atol=1e-6)
    assert torch.allclose(weights[:, region] / groups[:, 1:], doc.softmax(-1), atol=1e-6)


def test_cover_sets_and_their_fallback_is_full_attention(tiny):
    """`cover:t/rmax/rmin`: the fewest of `qattn:rmax/16`'s windows whose score, with C_1's,
    reaches `t` of the region's; else every token after C_1 (in `sequential`: full attention)."""
    region, first = sum(LENS), LENS[0]
    scores = torch.zeros(region)
    scores[:first] = 1.0  # C_1's share: first / (first + 6)
    scores[first + 2], scores[region - 1] = 4.0, 2.0
    share = first / (first + 6)
    assert hr.cover_choice(scores, LENS, f"{share:.4f}") == (set(), pytest.approx(share), False)
    # Ceiling 25 tokens: windows of 2 from C_2 on (the last, of 1, holds the last token).
    assert hr.cover_choice(scores, LENS, "0.85/1")[0] == {first + 2, first + 3}
    assert hr.cover_choice(scores, LENS, "1/1")[0] == {first + 2, first + 3, region - 1}
    assert hr.cover_choice(scores, LENS, "1/1/1")[0] == set(range(first, region))  # the floor: all
    fallback = hr.cover_choice(scores, LENS, "1/0.02")  # ceiling 1 token: one window of 1
    assert fallback[1:] == (pytest.approx((first + 4) / (first + 6)), True)
    assert (
        fallback[0]
        == hr.recompute_set("cover:1/0.02", SYS, LENS, attention=scores)
        == set(range(first, region))
    )
    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    full, _ = hr.run_full(tiny, PROMPT, max_tokens=6)
    assert hr.run(tiny, PROMPT, SYS, LENS, "sequential", fallback[0], kv, max_tokens=6).tokens == full.tokens
