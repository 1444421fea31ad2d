"""The GPU session's plan (`tools/gpu/session.sh`, docs/operator/gpu.md) run on the CPU as it runs on a lent
GPU, call by call, so that it cannot rot between loans: a bundle in two parts carried by two calls,
`receive prep` / `receive` / `receive install shapes test`, with the CPU stand-ins of
`GPU_SESSION_DRY_RUN=1` where CUDA is needed (the bundle checked and unpacked, not installed; the
long-context benchmark's three servers on the tiny dummy shape with random weights, its workload
scaled down; the GPU test cases on the CPU engine). What comes back
must fit what the device tool returns (at most 8 files in `$OUT`), and a step that no longer fits
the call's budget must be skipped and said, not killed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

from tests.helpers import REPO
from tools.gpu.bundle_build import ARCHIVE, compress, write_parts

SESSION = REPO / "tools" / "gpu" / "session.sh"
PROBE = "chunk_cache_probe-0.0.1-py3-none-any.whl"


def fake_bundle(root: Path) -> list[Path]:
    """A bundle of the real format (tar.xz of a stage, split, SHA256SUMS) holding one small wheel
    that no environment has, in parts of 1 MiB; the parts, SHA256SUMS last."""
    stage = root / "stage"
    (stage / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(stage / "wheels" / PROBE, "w") as whl:
        whl.writestr("chunk_cache_probe/__init__.py", "")
        whl.writestr(
            "chunk_cache_probe-0.0.1.dist-info/METADATA", "Name: chunk-cache-probe\nVersion: 0.0.1\n"
        )
        whl.writestr("chunk_cache_probe-0.0.1.dist-info/RECORD", "")
        # incompressible, so that the archive needs two parts
        whl.writestr("chunk_cache_probe/noise.bin", os.urandom(3 * 2**19), zipfile.ZIP_STORED)
    archive = root / ARCHIVE
    compress(stage, archive, level=0, threads=1)
    (root / "parts").mkdir()
    parts = write_parts(archive, root / "parts", part_mib=1)
    assert len(parts) == 2, parts
    return [*parts, root / "parts" / "SHA256SUMS"]


def call(tmp: Path, n: int, carried: list[Path], steps: list[str], **env: str) -> tuple[str, Path]:
    """One device call: `carried` under the carried folder (replacing the last call's), a fresh
    $OUT; the output and $OUT."""
    carry = tmp / "carried" / "parts"
    shutil.rmtree(carry, ignore_errors=True)
    carry.mkdir(parents=True)
    for path in carried:
        shutil.copy(path, carry)
    out = tmp / f"out{n}"
    run = subprocess.run(
        [str(SESSION), *steps],
        capture_output=True,
        text=True,
        timeout=1500,
        env={
            **os.environ,
            "GPU_SESSION_DRY_RUN": "1",
            "GPU_BUNDLE_CARRIED": str(tmp / "carried"),
            "GPU_BUNDLE_STORE": str(tmp / "store"),
            "GPU_SESSION_WORK": str(tmp / "work"),
            "OUT": str(out),
            "GPU_SESSION_BUDGET_S": "1500",
            **env,
        },
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return run.stdout, out


def steps_of(out: Path) -> dict[str, list[str]]:
    """steps.tsv: per step, its exit status, seconds and note."""
    return {
        line.split("\t")[0]: line.split("\t")[1:] for line in (out / "steps.tsv").read_text().splitlines()
    }


def returned(out: Path) -> list[str]:
    """What the device tool brings back from $OUT: every file must be one it can (at most 8,
    at most two folders down, plain names)."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    for p in files:
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3 and all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
    return sorted(str(p.relative_to(out)) for p in files)


def test_the_gpu_session_plan_on_the_cpu(tmp_path: Path):
    part0, part1, sums = fake_bundle(tmp_path / "bundle")

    said, out = call(tmp_path, 1, [part0, sums], ["receive", "prep"])
    assert "1 part(s) still to come" in said
    assert [s[0] for s in steps_of(out).values()] == ["0", "0"]
    assert "passed" in (out / "kernels.txt").read_text()

    said, out = call(tmp_path, 2, [part1], ["receive"])
    assert "0 part(s) still to come" in said

    said, out = call(
        tmp_path, 3, [], ["receive", "install", "shapes", "test"], GPU_SESSION_TESTS="sequential"
    )
    steps = steps_of(out)
    assert list(steps) == ["receive", "install", "shapes", "test"]
    assert all(status == "0" for status, *_ in steps.values()), steps
    assert set(returned(out)) == {
        "steps.tsv",
        "logs.tar.gz",
        "gpu_tests.json",
        "rag_tiny-llama3.1_cpu-dry-run.json",
        "rag_tiny-llama3.1_cpu-dry-run.png",
    }

    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
        install_log = tar.extractfile("logs/install.log").read().decode()
    assert {"logs/install.log", "logs/gpu_tests.xml", "logs/shapes.log"} <= set(names), names
    assert "would install 1 wheels" in install_log and PROBE in install_log, install_log

    report = json.loads((out / "gpu_tests.json").read_text())
    assert list(report) == ["tiny-llama3-sequential"], report
    assert report["tiny-llama3-sequential"]["answers"] == 20
    assert report["tiny-llama3-sequential"]["engine"]["scheduler"] == "ChunkCacheScheduler"

    bench = json.loads((out / "rag_tiny-llama3.1_cpu-dry-run.json").read_text())
    assert bench["weights"].startswith("random") and bench["settings"]["load_format"] == "dummy"
    assert list(bench["configs"]) == ["no_cache", "prefix", "chunk"]
    for name, config in bench["configs"].items():
        assert config.get("samples") and config.get("started_with_others"), config
        assert "--load-format dummy" in config["server_command"]
        assert any(s["phase"] == "variant" for s in config["samples"]) == (name == "chunk")
        assert config["concurrency"]["4"]["requests"] == 8
    assert list(bench["sets"]) == ["4x64", "8x32", "4x128"]
    for row in bench["sets"].values():
        assert all(row[k] for k in ("no_cache_warm_ms", "floor_ms", "chunk_warm_ms", "chunk_cold_ms")), row
        assert all(v["warm_ms"] and v["requests"] == 1 for v in row["variants"].values()), row
        assert row["variants"]["cover:0.7/0.2"]["fallback_rate"] is not None
    targets = bench["targets"]
    assert {"cold_overhead_4x128", "qattn_vs_full_qattn:0.15_8x32", "throughput_speedup_4"} <= set(targets)
    assert all(t["value"] for t in targets.values()), targets

    # A step that no longer fits the call's budget is skipped and said, and the call returns.
    said, out = call(tmp_path, 4, [], ["test"], GPU_SESSION_BUDGET_S="30")
    assert steps_of(out)["test"][0] == "skipped", said
