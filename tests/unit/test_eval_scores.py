"""`vllm-chunk-cache-eval`'s scores, intervals, summary and recommendation (no server)."""

from __future__ import annotations

import pytest

from vllm_ascend_chunk.eval import measure, report, scores


def test_wilson_interval_matches_the_textbook_values():
    assert scores.wilson(20, 20) == pytest.approx((0.8389, 1.0), abs=1e-4)
    assert scores.wilson(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)
    low, high = scores.wilson(10, 20)
    assert low == pytest.approx(0.2993, abs=1e-4) and high == pytest.approx(0.7007, abs=1e-4)
    assert scores.wilson(0, 0) == (0.0, 1.0)


def test_bootstrap_is_seeded_and_brackets_the_statistic():
    values = [float(v) for v in range(1, 41)]
    a = scores.bootstrap(values)
    assert a == scores.bootstrap(values)  # the same every run
    assert a[0] < 20.5 < a[1]
    assert scores.bootstrap([3.0, 3.0, 3.0], lambda xs: scores.percentile(xs, 0.9)) == (3.0, 3.0)
    assert scores.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


def test_scores_against_full_attention_and_the_gold():
    row = measure.score({"text": "The code is 4721."}, "The code is 4721.", ["4721"])
    assert row["agree"] == 1.0 and row["f1"] == 1.0 and row["contains"] == 1.0
    row = measure.score({"text": "It is 1234"}, "The code is 4721.", [])
    assert row["agree"] == 0.0 and 0 < row["f1"] < 1 and row["contains"] is None


def rows(agreeing: int, n: int = 20) -> list[dict]:
    return [
        {
            "agree": float(i < agreeing),
            "f1": 1.0,
            "contains": None,
            "ttft_s": 0.1,
            "computed": 0.2,
            "fallback": False,
        }
        for i in range(n)
    ]


def summary_of(**settings) -> dict:
    return {name: report.summarize(answers) for name, answers in settings.items()}


def test_the_cheapest_mode_whose_lower_bound_meets_the_target_is_recommended():
    full = rows(40, 40)
    fast, slow = rows(36, 40), rows(40, 40)
    for r in fast:
        r["ttft_s"] = 0.05
    for r in slow:
        r["ttft_s"] = 0.5
    s = summary_of(full=full, fast=fast, slow=slow)
    assert s["fast"]["agreement"]["low"] < 0.8 <= s["slow"]["agreement"]["low"]
    rec = report.recommend(s, ["fast", "slow"], 0.8)
    assert rec["setting"] == "slow"
    assert report.recommend(s, ["fast", "slow"], 0.75)["setting"] == "fast"  # both meet it: the cheaper


def test_none_meets_it_says_serve_full_attention_and_when_more_samples_are_needed():
    s = summary_of(full=rows(20), none=rows(20))
    rec = report.recommend(s, ["none"], 0.9)
    assert rec["setting"] is None
    assert rec["text"].startswith(report.NONE_MEETS)
    assert "with 20 samples even 100 % agreement's lower bound is 0.84" in rec["text"]


def test_table_has_a_line_per_setting_and_no_interval_where_none_is_known():
    s = summary_of(full=rows(20), none=rows(10))
    text = report.table(s)
    lines = text.splitlines()
    assert len(lines) == 3 and lines[0].startswith("setting")
    assert "0.50 [0.30, 0.70]" in lines[2]
    assert lines[2].split()[-3:] == ["0", "of", "20"]  # fallbacks


def test_the_guard_serves_b_where_a_and_b_agree_and_full_attention_where_not():
    def answer(text, ttft, latency, computed):
        return {"text": text, "ttft_s": ttft, "latency_s": latency, "computed": computed}

    row = {
        "answers": ["4721"],
        "full": answer("4721", 1.0, 2.0, 1.0),
        "A": answer("4721", 0.2, 0.5, 0.15),
        "B": answer("4721", 0.3, 0.6, 0.2),
    }
    g = measure.guarded(row, "A", "B")
    assert g["text"] == "4721" and not g["fallback"] and g["ttft_s"] == 0.6
    assert g["computed"] == pytest.approx(0.35)
    row["A"]["text"] = "1234"
    g = measure.guarded(row, "A", "B")
    assert g["fallback"] and g["agree"] == 1.0 and g["ttft_s"] == pytest.approx(1.6)
    assert g["computed"] == pytest.approx(1.35) and g["contains"] == 1.0
