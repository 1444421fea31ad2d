"""`vllm-chunk-cache-eval`'s samples: the JSONL and MuSiQue forms, bad lines, the built-in set."""

from __future__ import annotations

import json

from vllm_ascend_chunk.eval import samples


def test_jsonl_samples_bad_lines_by_number_and_the_others_go_on(tmp_path):
    path = tmp_path / "s.jsonl"
    lines = [
        json.dumps({"id": "a", "documents": ["One.", "Two."], "question": "Q?", "answers": ["x"]}),
        "{not json",
        json.dumps({"documents": ["One."]}),  # no question
        "",
        json.dumps({"documents": ["One.", "Three."], "question": "R?", "answers": "y", "system": "S"}),
        json.dumps({"id": "a", "documents": ["One."], "question": "again?"}),  # the id repeats
        json.dumps({"question": "Q?", "documents": "not a list"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    found, bad = samples.read(path)
    assert [(s.sid, s.line, s.answers, s.system) for s in found] == [
        ("a", 1, ["x"], None),
        ("line-5", 5, ["y"], "S"),
    ]
    assert [b["line"] for b in bad] == [2, 3, 6, 7]
    assert bad[0]["error"].startswith("not JSON")
    assert "question" in bad[1]["error"] and "repeats" in bad[2]["error"] and "documents" in bad[3]["error"]


def test_musique_forms(tmp_path):
    cacheblend = {
        "question": "Who?",
        "answers": "['Ada', 'Ada L.']",
        "ctxs": "[{'title': 'T1', 'text': 'First # passage.'}, {'title': 'T2', 'text': 'Second.'}]",
    }
    own = {
        "id": "2hop_1",
        "question": "Where?",
        "answer": "Paris",
        "answer_aliases": ["City of Light"],
        "paragraphs": [
            {"title": "P", "paragraph_text": "Text one."},
            {"title": "R", "paragraph_text": "Two."},
        ],
    }
    path = tmp_path / "musique_s.json"
    path.write_text(json.dumps([cacheblend, own]))
    found, bad = samples.read(path, docs=1)
    assert not bad
    assert found[0].answers == ["Ada", "Ada L."] and found[0].documents == ["T1 First # passage."]
    assert found[1].sid == "2hop_1" and found[1].answers == ["Paris", "City of Light"]


def test_the_built_in_set_is_deterministic_and_plants_its_answer():
    a = samples.generated(6, docs=5, seed=3)
    assert [s.__dict__ for s in a] == [s.__dict__ for s in samples.generated(6, docs=5, seed=3)]
    for s in a:
        assert len(s.documents) == 5
        assert sum(s.answers[0] in d for d in s.documents) >= 1
        assert 80 < len(s.documents[0].split()) < 160
    assert samples.digest(a) != samples.digest(samples.generated(6, docs=5, seed=4))
