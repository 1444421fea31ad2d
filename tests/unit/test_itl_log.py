"""The benchmarks' ITL recorder without a server: the plugin vLLM would find, what it writes, and
the paused-store benchmark's summary of it."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import bench_store_pause
from harness import itl_log


def test_the_plugin_env_makes_vllm_find_the_recorder_and_the_recorder_writes_each_itl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "itl.log"
    env = itl_log.plugin_env(tmp_path / "plugin", log)
    assert env[itl_log.LOG_ENV] == str(log)
    monkeypatch.setattr(sys, "path", [*env["PYTHONPATH"].split(os.pathsep), *sys.path])
    found = importlib.metadata.entry_points(group="vllm.stat_logger_plugins")
    assert [p.load() for p in found if p.name == itl_log.PLUGIN] == [itl_log.ItlFileLogger]

    monkeypatch.setenv(itl_log.LOG_ENV, str(log))
    recorder = itl_log.ItlFileLogger(vllm_config=None)
    recorder.record(None, SimpleNamespace(inter_token_latencies_iter=[0.0021, 0.5]))
    recorder.record(None, None)  # a step without outputs
    recorder.record(None, SimpleNamespace(inter_token_latencies_iter=[]))
    recorder.record(None, SimpleNamespace(inter_token_latencies_iter=[1.25]))
    assert itl_log.read(log) == [0.0021, 0.5, 1.25]
    with log.open("a") as f:
        f.write("0.3")  # a line still being written
    assert itl_log.read(log) == [0.0021, 0.5, 1.25]


def test_a_server_told_which_plugins_to_load_is_told_to_load_the_recorder_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert "VLLM_PLUGINS" not in itl_log.plugin_env(tmp_path, tmp_path / "itl.log")
    monkeypatch.setenv("VLLM_PLUGINS", "chunk_cache")
    assert (
        itl_log.plugin_env(tmp_path, tmp_path / "itl.log")["VLLM_PLUGINS"] == f"chunk_cache,{itl_log.PLUGIN}"
    )


def test_the_recorder_refuses_to_start_without_its_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(itl_log.LOG_ENV, raising=False)
    with pytest.raises(RuntimeError, match=itl_log.LOG_ENV):
        itl_log.ItlFileLogger(vllm_config=None)


def test_the_window_summary_takes_exact_quantiles_from_the_samples() -> None:
    itls_ms = [float(i) for i in range(1, 201)] + [1500.0]
    summary = bench_store_pause.itl_summary(itls_ms, {0.01: 9.0, float("inf"): 201.0})
    assert summary["itl_count"] == 201
    assert summary["itl_p50_ms"] == 101.0
    assert summary["itl_p99_ms"] == 199.0
    assert summary["itl_over_1s"] == 1
    assert summary["itl_mean_ms"] == pytest.approx((200 * 201 / 2 + 1500) / 201)
    assert summary["itl_histogram_count"] == 201
    assert bench_store_pause.itl_summary([], {})["itl_p99_ms"] is None
