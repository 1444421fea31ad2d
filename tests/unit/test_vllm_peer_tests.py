"""The pure parts of `tools/peer/vllm_peer_tests.py` (junit parsing, diffing, summary, the activation
check) on synthetic reports, and the local model stand-ins; the peer suite itself takes long and
is run by hand."""

from __future__ import annotations

import json

from tools.peer import vllm_peer_tests as peer


def junit(*cases: str) -> str:
    return (
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
        + "".join(cases)
        + "</testsuite></testsuites>"
    )


def case(name: str, body: str = "", classname: str = "tests.v1.core.test_x") -> str:
    return f'<testcase classname="{classname}" name="{name}" time="0.1">{body}</testcase>'


FAIL = '<failure message="ValueError: Chunk Cache does not support the KV connector 42">tb</failure>'
PRISTINE = junit(
    case("test_a"),
    case("test_b"),
    case("test_c", '<skipped message="no GPU"/>'),
    case("test_d", '<error message="fixture missing">tb</error>'),
)
ON = junit(
    case("test_a"),
    case("test_b", FAIL),
    case("test_c", '<skipped message="no GPU"/>'),
    case("test_d", '<error message="fixture missing">tb</error>'),
    case("test_b", '<error message="teardown">tb</error>'),  # teardown error of test_b
    case("tests.v1.core.test_y", '<error message="collection failure"/>', classname=""),
)


def test_parse_junit_outcomes():
    got = peer.parse_junit(ON)
    assert {t: o.outcome for t, o in got.items()} == {
        "tests.v1.core.test_x::test_a": "passed",
        "tests.v1.core.test_x::test_b": "failed",
        "tests.v1.core.test_x::test_c": "skipped",
        "tests.v1.core.test_x::test_d": "error",
        "tests.v1.core.test_y": "error",
    }
    assert got["tests.v1.core.test_x::test_b"].message.startswith("ValueError: Chunk Cache")


def test_differences_and_summary():
    results = {"pristine": peer.parse_junit(PRISTINE), "on": peer.parse_junit(ON)}
    diffs = peer.differences(results, "pristine", "on")
    assert [(d["test"], d["pristine"], d["on"]) for d in diffs] == [
        ("tests.v1.core.test_x::test_b", "passed", "failed"),
        ("tests.v1.core.test_y", "absent", "error"),
    ]
    text = peer.summary(results, [("pristine", "on")])
    assert "pristine  2 passed, 1 error, 1 skipped" in text
    assert "pristine -> on: 2 tests differ" in text
    assert "1  passed -> failed: ValueError: Chunk Cache does not support the KV connector N" in text


def test_report_reads_junit_files(tmp_path):
    (tmp_path / "pristine-core.xml").write_text(PRISTINE)
    (tmp_path / "on-core.xml").write_text(ON)
    text = peer.report(tmp_path, ["pristine", "on"])
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["differences"]["pristine->on"]) == 2
    assert data["outcomes"]["on"]["tests.v1.core.test_x::test_b"]["outcome"] == "failed"
    assert (tmp_path / "summary.txt").read_text() == text + "\n"


def test_a_run_where_on_never_turned_it_on_fails(tmp_path):
    (tmp_path / "off-core.xml").write_text(PRISTINE)
    (tmp_path / "on-core.xml").write_text(ON)
    (tmp_path / "off-core.activation.json").write_text(json.dumps({"active": [], "refused": []}))
    (tmp_path / "on-core.activation.json").write_text(json.dumps({"active": [], "refused": ["t::b"]}))
    text = peer.report(tmp_path, ["off", "on"])
    assert "  on        0 on, 1 refused" in text
    assert "FAILED: mode on: the chunk cache was configured on in no test" in text
    (tmp_path / "on-core.activation.json").write_text(json.dumps({"active": ["t::a"], "refused": ["t::b"]}))
    (tmp_path / "off-core.activation.json").write_text(json.dumps({"active": ["t::a"], "refused": []}))
    text = peer.report(tmp_path, ["off", "on"])
    assert "FAILED: mode off: the chunk cache was configured on or refused in 1 tests" in text
    assert "mode on" not in text
    assert json.loads((tmp_path / "results.json").read_text())["activations"]["on"]["active"] == ["t::a"]


def test_the_stand_ins_are_a_hub_cache(tmp_path):
    from tools.peer import models as peer_models

    home = peer_models.write_cache(tmp_path)
    snapshot = home / "hub" / "models--facebook--opt-125m" / "snapshots" / peer_models.REVISION
    config = json.loads((snapshot / "config.json").read_text())
    assert config["architectures"] == ["OPTForCausalLM"] and config["model_type"] == "opt"
    assert (snapshot.parent.parent / "refs" / "main").read_text() == peer_models.REVISION
    assert peer_models.write_cache(tmp_path) == home  # again: the same
