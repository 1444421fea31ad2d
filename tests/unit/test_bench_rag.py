"""The RAG benchmark without servers: presets (`bench_rag`), server settings (`rag_servers`),
concurrency streams, targets (`rag_summary`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks import bench_rag, rag_servers, rag_sets, rag_summary
from harness import rag_workload
from harness.serve_util import REPO


def args_for(*argv: str):
    args = bench_rag.build_parser().parse_args(list(argv))
    bench_rag.resolve_defaults(args)
    args.served_name = args.model.name
    return args


def test_the_default_workload_is_the_one_the_committed_results_used():
    """The requests of `results/rag/rag_cpu.json`, which also records each one's size in `meta`."""
    requests = [asdict(r) for r in rag_workload.build_workload().requests]
    committed = json.loads((REPO / "results" / "rag" / "rag_cpu.json").read_text())["workload"]
    assert [{**r, "meta": {}} for r in requests] == [{**r, "meta": {}} for r in committed["requests"]]
    assert all(r["meta"].get("n_docs", len(r["doc_ids"])) == len(r["doc_ids"]) for r in committed["requests"])


def test_long_preset():
    args = args_for("--long")
    assert (args.doc_tokens, tuple(args.sweep_sizes), args.max_model_len) == (1024, (1, 8, 32), 40960)
    assert args.configs == "no_cache,chunk" and args.out.name == "rag_cpu_long.json"
    w = bench_rag.workload_from_args(args)
    assert {r.phase for r in w.requests} == {"warmup", "sweep"}
    assert max(len(r.doc_ids) for r in w.requests) == 32
    explicit = args_for("--long", "--doc-tokens", "256", "--configs", "chunk")
    assert explicit.doc_tokens == 256 and explicit.configs == "chunk"


def test_concurrency_streams_are_fresh_and_the_same_for_every_configuration():
    args = args_for("--concurrency-only", "--concurrency", "16,64", "--concurrency-requests", "40")
    w = bench_rag.workload_from_args(args)
    assert {r.phase for r in w.requests} == {"warmup"}
    a, b = bench_rag.concurrency_streams(args, w), bench_rag.concurrency_streams(args, w)
    assert [asdict(r) for r in a[16]] == [asdict(r) for r in b[16]]
    assert len(a[16]) == len(a[64]) == 40
    assert [r.doc_ids for r in a[16]] != [r.doc_ids for r in a[64]]
    questions = [r.question_seed for level in a.values() for r in level]
    assert len(set(questions)) == len(questions)
    assert all(
        rag_workload.STREAM_SEEDS <= d < rag_workload.STREAM_SEEDS + 48
        for level in a.values()
        for r in level
        for d in r.doc_ids
    )


def test_every_configuration_gets_the_same_cpu_reservation(tmp_path: Path):
    args = args_for("--model", str(tmp_path))
    envs = [rag_servers.server_env(c, args) for c in rag_servers.CONFIGS]
    assert {e["VLLM_CPU_NUM_OF_RESERVED_CPU"] for e in envs} == {"1"}
    assert [e["VLLM_ENABLE_CHUNK_CACHE"] for e in envs] == ["false", "false", "true", "true"]
    assert [e["VLLM_CHUNK_CACHE_RECOVERY"] for e in envs] == ["none", "none", "none", "qattn:0.2"]
    extra = args_for("--model", str(tmp_path), "--server-env=A=1", "--server-env", "B=x=y")
    assert {k: rag_servers.server_env("chunk", extra)[k] for k in "AB"} == {"A": "1", "B": "x=y"}
    for bad in ("A", "=1"):
        with pytest.raises(SystemExit):  # argparse's usage error, naming the argument
            args_for("--model", str(tmp_path), f"--server-env={bad}")


def test_a_longer_context_than_the_model_knows_overrides_its_positions(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 16384}))
    short = rag_servers.server_args("chunk", args_for("--model", str(tmp_path)))
    assert "--hf-overrides" not in short
    long = rag_servers.server_args("chunk", args_for("--model", str(tmp_path), "--long"))
    assert json.loads(long[long.index("--hf-overrides") + 1]) == {"max_position_embeddings": 40960}


def sample(phase, label, n_docs, ttft):
    return {"phase": phase, "label": label, "n_docs": n_docs, "ttft_ms": ttft}


def test_targets_long_concurrency_and_itl():
    results = {
        "no_cache": {"samples": [sample("sweep", "cold", 32, 50_000), sample("sweep", "warm", 32, 60_000)]},
        "prefix": {
            "samples": [sample("warmup", "cold", 4, 10)],
            "concurrency": {"64": {"requests_per_s": 1.0}, "16": {"requests_per_s": 2.0}},
        },
        "chunk": {
            "samples": [sample("sweep", "cold", 32, 9_000), sample("sweep", "warm", 32, 500)],
            "concurrency": {"64": {"requests_per_s": 6.0}, "16": {"requests_per_s": 8.0}},
        },
    }
    itl = {"summary": {"ordinary_overhead_paired_median": 0.025, "chunked_overhead_paired_median": -0.1}}
    t = rag_summary.targets(results, long=True, itl=itl)
    assert t["warm_speedup"]["value"] == pytest.approx(120) and t["warm_speedup"]["pass"]
    assert t["cold_overhead"]["value"] == pytest.approx(0.18)
    assert "shuffled_speedup" not in t
    assert t["throughput_speedup_64"]["value"] == pytest.approx(6) and t["throughput_speedup_64"]["pass"]
    assert t["throughput_speedup_16"]["value"] == pytest.approx(4) and not t["throughput_speedup_16"]["pass"]
    assert not t["itl_overhead_ordinary"]["pass"] and t["itl_overhead_chunked"]["pass"]


def test_floor_repeats_each_warm_sweep_request_as_it_is_and_gives_the_floor_target():
    w = bench_rag.workload_from_args(args_for("--quick", "--floor"))
    plain = bench_rag.workload_from_args(args_for("--quick"))
    repeats = [(i, r) for i, r in enumerate(w.requests) if r.phase == "repeat"]
    assert len(repeats) == sum(r.phase == "sweep" and r.label == "warm" for r in plain.requests) > 0
    for i, r in repeats:
        before = w.requests[i - 1]
        assert (before.phase, before.label) == ("sweep", "warm")
        assert (r.doc_ids, r.question_seed) == (before.doc_ids, before.question_seed)
    assert [asdict(r) for r in w.requests if r.phase != "repeat"] == [asdict(r) for r in plain.requests]
    results = {
        "prefix": {"samples": [sample("sweep", "warm", 8, 900), sample("repeat", "warm", 8, 50)]},
        "chunk": {"samples": [sample("sweep", "warm", 8, 55), sample("repeat", "warm", 8, 40)]},
    }
    t = rag_summary.targets(results)
    assert t["floor_ratio"]["value"] == pytest.approx(1.1) and t["floor_ratio"]["pass"]
    assert "floor_ratio" not in rag_summary.targets({"chunk": results["chunk"]})


def test_long_sets_preset_sends_every_set_cold_warm_floor_and_variants():
    args = args_for("--long-sets", "--model", str(REPO / ".models" / "dummy-llama3.1-8b"))
    assert args.doc_sets == ((8, 2048), (32, 1024), (16, 4096)) and args.floor
    assert args.recovery_variants == ("qattn:0.15", "cover:0.7/0.2")
    assert (args.configs, args.concurrency, args.max_model_len) == ("no_cache,prefix,chunk", (16,), 77824)
    assert args.out.name == "rag_dummy-llama3.1-8b_long_sets.json"
    w = bench_rag.workload_from_args(args)
    sweep = [r for r in w.requests if r.phase != "warmup"]
    assert [(r.phase, r.label, len(r.doc_ids), r.meta.get("recovery")) for r in sweep[:7]] == [
        ("sweep", "cold", 8, None),
        *[("sweep", "warm", 8, None), ("repeat", "warm", 8, None)],
        ("variant", "warm", 8, "qattn:0.15"),
        ("variant", "warm", 8, "cover:0.7/0.2"),
        ("sweep", "warm", 8, None),
        ("repeat", "warm", 8, None),
    ]
    assert {r.meta["doc_tokens"] for r in sweep if len(r.doc_ids) == 16} == {4096}
    for n in (8, 32, 16):  # no two requests of a set but a repeat share a first document
        firsts = [r.doc_ids[0] for r in sweep if len(r.doc_ids) == n and r.phase != "repeat"]
        assert len(firsts) == len(set(firsts)) == 7
    assert len(w.prompt(sweep[0])) > 8 * 2048 * 2  # ~3 characters a token
    streams = bench_rag.concurrency_streams(args, w)
    assert list(streams) == [16] and all(8 <= len(r.doc_ids) <= 16 for r in streams[16])
    with pytest.raises(ValueError, match="too few orders"):
        bench_rag.workload_from_args(args_for("--doc-sets", "4x64", "--recovery-variants", "qattn:0.2,last"))


def test_dummy_weights_are_asked_for_and_said(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 16384}))
    with pytest.raises(SystemExit, match="--load-format dummy"):
        bench_rag.selected_configs(args_for("--model", str(tmp_path)))
    args = args_for("--model", str(tmp_path), "--load-format", "dummy")
    assert bench_rag.selected_configs(args) == ["no_cache", "prefix", "chunk"]
    served = rag_servers.server_args("chunk", args)
    assert served[served.index("--load-format") + 1] == "dummy"
    assert "--load-format" not in rag_servers.server_args("chunk", args_for("--model", str(tmp_path)))
    report = bench_rag.new_report(args, [], bench_rag.workload_from_args(args), {})
    assert report["weights"] == bench_rag.DUMMY_WEIGHTS


def test_set_table_and_targets():
    def s(config_ttft, phase, label, recovery=None, **counters):
        return {
            "phase": phase, "label": label, "n_docs": 32, "doc_tokens": 1024, "ttft_ms": config_ttft,
            "prompt_tokens": 36_000, "recovery": recovery, **counters,
        }  # fmt: skip

    results = {
        "no_cache": {
            "samples": [s(2000, "sweep", "cold"), s(1900, "sweep", "warm"), s(1900, "repeat", "warm")]
        },
        "prefix": {"samples": [s(2000, "sweep", "cold"), s(1900, "sweep", "warm"), s(50, "repeat", "warm")]},
        "chunk": {
            "samples": [
                s(2200, "sweep", "cold"),
                s(55, "sweep", "warm"),
                s(50, "repeat", "warm"),
                s(500, "variant", "warm", "qattn:0.15", selected_tokens=4800, cover_fallbacks=0),
                s(1800, "variant", "warm", "cover:0.7/0.2", selected_tokens=0, cover_fallbacks=1),
            ]
        },
    }
    table = rag_sets.set_table(results)
    row = table["32x1024"]
    assert row["warm_speedup"] == pytest.approx(1900 / 55) and row["floor_ratio"] == pytest.approx(1.1)
    assert row["cold_overhead"] == pytest.approx(1.1)
    assert row["variants"]["qattn:0.15"]["vs_full"] == pytest.approx(500 / 1900)
    assert row["variants"]["cover:0.7/0.2"]["fallback_rate"] == 1.0
    t = rag_sets.set_targets(table)
    assert {k for k, v in t.items() if v["pass"]} == {
        "warm_speedup_32x1024",
        "floor_ratio_32x1024",
        "cold_overhead_32x1024",
        "qattn_vs_full_qattn:0.15_32x1024",
    }
    assert rag_summary.sweep_key(results["chunk"]["samples"][0]) == "32x1024"
    assert "warm_speedup" not in rag_summary.targets(results, ttft=False)
