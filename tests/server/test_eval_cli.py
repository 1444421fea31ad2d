"""`vllm-chunk-cache-eval` against a real `vllm serve` (tiny Llama, chunk cache on; random weights:
the answers are noise, the requests, counters and files are real): a run of the built-in set
writing its table, JSON and PNG, `--guard`, `--resume`, and the errors a user meets: an
unreachable URL, a model name the server does not serve, samples longer than the server's
context, a bad sample line, and a server with the chunk cache off (a second server, started
after the first is stopped). An unpatched server: `tests/unit/test_eval_client.py` (stand-in)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest

from harness.serve_util import free_port
from tests.helpers import REPO
from tests.helpers.server_utils import vllm_server
from vllm_ascend_chunk.eval import cli

RUN = ["--model", "tiny-llama", "--builtin", "3", "--docs", "3", "--doc-words", "40", "--max-tokens", "4"]
MODES = ["--modes", "none,qattn:0.2", "--guard", "none,qattn:0.2"]


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    """The module's server (chunk cache on): its URL; `STOP[0]()` ends it early (the last test)."""
    log = tmp_path_factory.mktemp("eval-server") / "vllm-serve.log"
    env = {"VLLM_ENABLE_CHUNK_CACHE": "1", "VLLM_CHUNK_CACHE_SIZE_GB": None}
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(vllm_server(models_dir / "tiny-llama", log, env=env))
        STOP[:] = [stack.close]
        yield url


STOP: list = []


def evaluate(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture(scope="module")
def first_run(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "eval.json"
    capture = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_ascend_chunk.eval",
            "--base-url",
            server,
            *RUN,
            *MODES,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert capture.returncode == 0, capture.stderr
    return out, capture.stdout, capture.stderr


def test_a_run_writes_the_table_the_json_and_the_png(first_run):
    out, stdout, stderr = first_run
    doc = json.loads(out.read_text())
    assert doc["complete"] and [r["sid"] for r in doc["rows"]] == [f"gen-0-{i}" for i in range(3)]
    assert list(doc["summary"]) == ["full", "none", "qattn:0.2", "guard:none,qattn:0.2"]
    s = doc["summary"]
    assert s["full"]["agreement"]["mean"] == 1.0 and s["full"]["computed"]["mean"] > 0.9
    # Plain reuse loads the documents: it computes the question only; qattn recomputes ~20 % more.
    assert s["none"]["computed"]["mean"] < 0.3 < s["full"]["computed"]["mean"]
    assert s["qattn:0.2"]["computed"]["mean"] > s["none"]["computed"]["mean"] + 0.1
    assert s["none"]["fallbacks"]["count"] == 0
    for setting in s.values():
        assert setting["agreement"]["low"] <= setting["agreement"]["mean"] <= setting["agreement"]["high"]
        assert setting["ttft_p50_ms"]["value"] > 0 and setting["contains"] is not None
    assert doc["recommendation"]["text"]  # 3 samples: no lower bound reaches 0.9
    assert doc["recommendation"]["setting"] is None and "measure more" in doc["recommendation"]["text"]
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert stdout.splitlines()[0].split()[:3] == ["setting", "agreement", "F1"]
    assert (
        "guard:none,qattn:0.2" in stdout and "recommendation (--min-agreement 0.9): none meets it" in stdout
    )
    assert "3/3 samples" in stderr and "ETA" in stderr


def test_the_guard_serves_qattn_where_both_agree_else_full_attention(first_run):
    doc = json.loads(first_run[0].read_text())
    guard = doc["summary"]["guard:none,qattn:0.2"]
    differ = sum(r["none"]["text"] != r["qattn:0.2"]["text"] for r in doc["rows"])
    assert guard["fallbacks"]["count"] == differ
    assert guard["agreement"]["mean"] >= doc["summary"]["qattn:0.2"]["agreement"]["mean"]


def test_resume_measures_only_what_the_file_lacks(server, first_run, tmp_path, capsys):
    doc = json.loads(first_run[0].read_text())
    out = tmp_path / "eval.json"
    kept = doc["rows"][:2]
    out.write_text(json.dumps({**doc, "rows": kept, "complete": False}))
    rc, _, err = evaluate(capsys, "--base-url", server, *RUN, *MODES, "--out", out)
    assert rc == 2 and "exists" in err and "--resume" in err
    rc, stdout, err = evaluate(capsys, "--base-url", server, *RUN, *MODES, "--out", out, "--resume")
    assert rc == 0, err
    again = json.loads(out.read_text())
    assert again["rows"][:2] == kept and again["rows"][2]["sid"] == "gen-0-2" and again["complete"]
    assert "3/3 samples" in err and err.count("samples,") == 1  # one sample measured
    rc, _, err = evaluate(capsys, "--base-url", server, *RUN, "--modes", "none", "--out", out, "--resume")
    assert rc == 2 and "other settings (modes, guard)" in err


def test_concurrency_reports_the_counters_for_the_whole_run_only(server, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc, stdout, err = evaluate(
        capsys, "--base-url", server, *RUN, "--modes", "none", "--concurrency", 2, "--out", out
    )
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert not doc["counters_per_request"] and doc["summary"]["none"]["computed"] is None
    assert doc["set_counters"]["vllm:chunk_cache_selected_tokens_total"] == 0
    assert "cannot be attributed to one request" in stdout and len(doc["rows"]) == 3


def test_an_unreachable_server(tmp_path):
    out = tmp_path / "eval.json"
    url = f"http://127.0.0.1:{free_port()}"
    run = subprocess.run(
        [sys.executable, "-m", "vllm_ascend_chunk.eval", "--base-url", url, *RUN, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert run.returncode == 2 and f"cannot reach the server at {url}" in run.stderr
    assert "fix: start `vllm serve` there, or pass the right --base-url" in run.stderr
    assert not out.exists()


def test_a_model_the_server_does_not_serve(server, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc, _, err = evaluate(capsys, "--base-url", server, *RUN, "--model", "Qwen3-8B", "--out", out)
    assert rc == 2 and "does not serve a model named 'Qwen3-8B'; it serves 'tiny-llama'" in err
    assert "fix: pass --model tiny-llama" in err and not out.exists()


def test_samples_too_long_and_a_bad_line(server, tmp_path, capsys):
    good = {"id": "ok", "documents": ["The gate code is 4721.", "The bridge is red."], "question": "Code?"}
    long = {"id": "long", "documents": ["word " * 5000, "short"], "question": "What?", "answers": ["x"]}
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join([json.dumps(good), "{oops", json.dumps(long)]) + "\n")
    out = tmp_path / "eval.json"
    args = ["--base-url", server, "--model", "tiny-llama", "--samples", path, "--modes", "none", "--out", out]
    rc, _, err = evaluate(capsys, *args, "--max-tokens", "4")
    assert f"{path}:2: not JSON" in err and "skipped" in err
    assert rc == 2 and "1 samples do not fit the server's max_model_len 4096" in err and "long (" in err
    assert "fix: serve with --max-model-len" in err and "--skip-long" in err and not out.exists()
    rc, stdout, err = evaluate(capsys, *args, "--max-tokens", "4", "--skip-long")
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert [r["sid"] for r in doc["rows"]] == ["ok"]
    assert [(s.get("sid"), s["line"]) for s in doc["skipped"]] == [(None, 2), ("long", 3)]
    assert doc["summary"]["none"]["contains"] is None  # no answers given: scored against full only


def test_a_server_with_the_chunk_cache_off(server, models_dir, tmp_path, capsys):
    """Last: the module's server is stopped first (one server at a time)."""
    STOP[0]()
    env = {"VLLM_ENABLE_CHUNK_CACHE": "0"}
    out = tmp_path / "eval.json"
    with vllm_server(models_dir / "tiny-llama", tmp_path / "off.log", env=env) as url:
        rc, _, err = evaluate(capsys, "--base-url", url, *RUN, "--out", out)
    assert rc == 2 and "the chunk cache is off on this server" in err
    assert "fix: restart the server with VLLM_ENABLE_CHUNK_CACHE=1" in err and not out.exists()
