"""`benchmarks/explore_recovery.py` without a model: shards, merges, skipped questions, the oracles."""

import argparse
import json
import sys
import time

import pytest

from benchmarks import explore_recovery as er
from benchmarks.quality_data import QAItem


def test_shards_cover_every_question_once():
    items = list(range(11))
    shards = [er.shard_of(items, f"{k}/4") for k in range(4)]
    assert sorted(x for shard in shards for x in shard) == items
    assert shards[1] == [1, 5, 9]
    assert er.shard_of(items, None) == items
    with pytest.raises(SystemExit, match="0 <= K < N"):
        er.shard_of(items, "4/4")


def _run(path, indices, configs=("sequential/plain",), seconds=10.0):
    def row(agree):
        return {
            "agree": agree,
            "contains": agree,
            "kl": 0.0,
            "f1": 0.0,
            "em": 0.0,
            "recompute": 0.1,
            "doc_recompute": 0.1,
        }

    samples = [
        {"qid": f"q{i}", "index": i, "configs": {"full": row(1.0), **{c: row(float(i % 2)) for c in configs}}}
        for i in indices
    ]
    path.write_text(
        json.dumps(
            {
                "command": f"run {path.name}",
                "model": "m",
                "machine": "x",
                "device": "cpu",
                "torch": "t",
                "seconds": seconds,
                "settings": {"configs": list(configs), "shard": "0/2", "out": path.name},
                "samples": samples,
            }
        )
    )
    return path


def test_merge_orders_questions_and_recomputes_the_summary(tmp_path):
    a = _run(tmp_path / "a.json", [0, 2, 4], seconds=30.0)
    b = _run(tmp_path / "b.json", [1, 3], seconds=20.0)
    result = er.merge([b, a], tmp_path / "m.json")
    assert [s["index"] for s in result["samples"]] == [0, 1, 2, 3, 4]
    assert result["summary"]["sequential/plain"]["n"] == 5
    assert result["summary"]["sequential/plain"]["agreement"] == pytest.approx(2 / 5)
    assert result["seconds"] == 30.0 and result["seconds_all_processes"] == 50.0
    assert "shard" not in result["settings"] and result["device"] == "cpu"
    assert json.loads((tmp_path / "m.json").read_text())["samples"] == result["samples"]


def test_merge_refuses_runs_of_other_configurations(tmp_path):
    a = _run(tmp_path / "a.json", [0])
    b = _run(tmp_path / "b.json", [1], configs=("sequential/qattn:0.1/16",))
    with pytest.raises(SystemExit, match="other configurations"):
        er.merge([a, b], tmp_path / "m.json")


def test_questions_done_by_an_earlier_run(tmp_path):
    """`--skip-done`: a later loan leaves out the questions an earlier one's results hold."""
    a = _run(tmp_path / "a.json", [0, 2])
    b = _run(tmp_path / "b.json", [3])
    assert er.questions_done([a, b], ["sequential/plain"]) == {0, 2, 3}
    assert er.questions_done([], ["sequential/plain"]) == set()
    with pytest.raises(SystemExit, match="other configurations"):
        er.questions_done([a], ["sequential/qattn:0.1/16"])


def test_a_run_that_skips_earlier_questions_writes_its_results(tmp_path):
    """`--skip-done` paths are written with the run's settings (a list of paths once stopped every
    shard of a loan at its first question)."""
    earlier = _run(tmp_path / "earlier.json", [0])
    args = argparse.Namespace(
        out=tmp_path / "out.json", model="m", configs=["sequential/plain"], skip_done=[earlier]
    )
    args.device_name = "cpu"
    er.write(args, [], time.time(), "t")
    written = json.loads(args.out.read_text())["settings"]
    assert written["skip_done"] == ["earlier.json"] and written["configs"] == ["sequential/plain"]


def test_a_shard_with_no_question_left_ends_without_a_model_or_a_file(tmp_path, monkeypatch, capsys):
    """A set that earlier loans finished: its shards end at once, cleanly (they used to load the
    model, then fail printing an empty summary, marking the GPU plan's `explore` step failed)."""
    # Two questions in MuSiQue's form: the synthetic set needs its essays (requirements/quality.txt).
    data = tmp_path / "musique_s.json"
    row = {"question": "q?", "answers": ["a"], "ctxs": [{"title": "t", "text": "x"}]}
    data.write_text(json.dumps([row, row]))
    earlier = _run(tmp_path / "earlier.json", [0, 1])
    out = tmp_path / "out.json"
    argv = ["explore_recovery", "--data", str(data), "--configs", "sequential/plain", "--model", "absent"]
    monkeypatch.setattr(
        sys, "argv", [*argv, "--skip-done", str(earlier), "--shard", "1/2", "--out", str(out)]
    )
    er.main()
    assert "no question left" in capsys.readouterr().out and not out.exists()


def test_a_merge_of_runs_on_two_machines_names_both(tmp_path):
    a = _run(tmp_path / "a.json", [0])
    b = _run(tmp_path / "b.json", [1])
    b.write_text(b.read_text().replace('"device": "cpu"', '"device": "NVIDIA H200"'))
    result = er.merge([b, a], tmp_path / "m.json")
    assert result["device"] == "NVIDIA H200 + cpu" and result["machine"] == "x"


def test_the_gold_oracles_name_the_document_with_the_answer_or_every_other():
    item = QAItem("q", "?", ["a"], docs=["d0", "d1", "d2"], meta={"needle_doc": 1})
    assert er.gold_mode("gold", item) == "chunks:1"
    assert er.gold_mode("gold-rest", item) == "chunks:0+2"
    assert er.gold_mode("qdoc:1", item) == "qdoc:1"
    alone = QAItem("q", "?", ["a"], docs=["d0"], meta={"needle_doc": 0})
    assert er.gold_mode("gold-rest", alone) == "plain"
    with pytest.raises(SystemExit, match="needs a synthetic question"):
        er.gold_mode("gold", QAItem("q", "?", ["a"], docs=["d0"]))
