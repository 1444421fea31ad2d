"""scripts/apply_patches.sh and tools/dev/regen_patches.py on a scratch copy of the installed vLLM."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.patch_helpers import (
    APPLY,
    REPO,
    copy_installed_vllm,
    regenerates_the_committed_series,
    run,
    series,
    touched_files,
    tree_bytes,
)

SERIES = REPO / "patches" / "vllm"
PATCHES = series("vllm")


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """The files the series touches, plus _version.py, copied from the installed vLLM and reverted."""
    copy_installed_vllm(tmp_path)
    assert run("--revert", target=tmp_path).returncode == 0
    return tmp_path


def test_series_is_not_empty():
    assert PATCHES, "the vLLM series must hold at least one patch"
    assert (SERIES / "TARGET_VERSION").read_text().strip() == "0.23.0"


def test_apply_is_idempotent_and_revert_restores_pristine(scratch: Path):
    pristine = tree_bytes(scratch)

    check = run("--check", target=scratch)
    assert check.returncode == 1
    assert check.stdout.count("not applied") == len(PATCHES)

    first = run(target=scratch)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("applied ") == len(PATCHES)
    patched = tree_bytes(scratch)
    assert patched != pristine

    second = run(target=scratch)
    assert second.returncode == 0
    assert "already applied; nothing to do" in second.stdout
    assert tree_bytes(scratch) == patched

    check = run("--check", target=scratch)
    assert check.returncode == 0
    assert check.stdout.count("applied") == len(PATCHES) and "not applied" not in check.stdout
    assert "at run time, no patch" in check.stdout and "impl.forward" in check.stdout

    revert = run("--revert", target=scratch)
    assert revert.returncode == 0
    assert tree_bytes(scratch) == pristine
    assert "nothing to revert" in run("--revert", target=scratch).stdout


def test_partially_applied_series_is_completed(scratch: Path):
    subprocess.run(["patch", "-p1", "-d", str(scratch), "-s"], stdin=PATCHES[0].open(), check=True)
    assert run(target=scratch).returncode == 0
    assert run("--check", target=scratch).returncode == 0


def test_version_mismatch_is_refused_and_changes_nothing(scratch: Path):
    version = scratch / "vllm" / "_version.py"
    version.write_text(version.read_text().replace("'0.23.0'", "'0.24.1'"))
    before = tree_bytes(scratch)
    for args in ((), ("--check",), ("--revert",)):
        result = run(*args, target=scratch)
        assert result.returncode == 3
        assert "vllm 0.24.1" in result.stderr and "targets vllm 0.23.0" in result.stderr
    assert tree_bytes(scratch) == before


def test_conflict_is_reported_and_changes_nothing(scratch: Path):
    patch_text = PATCHES[-1].read_text()
    victim = scratch / touched_files(PATCHES[-1])[0]
    hunk = patch_text[patch_text.index("\n@@") :].splitlines()[2:]
    source = victim.read_text()
    context = next(
        line[1:] for line in hunk if line[:1] in " -" and line[1:].strip() and source.count(line[1:]) == 1
    )
    victim.write_text(source.replace(context, context + "  # a local edit"))
    before = tree_bytes(scratch)
    result = run(target=scratch)
    assert result.returncode == 2
    assert "CONFLICT" in result.stdout and "Nothing was changed" in result.stderr
    assert tree_bytes(scratch) == before
    assert run("--check", target=scratch).returncode == 2


def test_missing_vllm_is_a_clear_error(tmp_path: Path):
    result = run(target=tmp_path)
    assert result.returncode == 4 and "vllm is not installed" in result.stderr


def test_installed_vllm_has_the_series_applied():
    result = subprocess.run(
        [str(APPLY), "--check", "--python", sys.executable], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_regeneration_reproduces_the_committed_series(scratch: Path, tmp_path_factory):
    pristine = tmp_path_factory.mktemp("pristine")
    shutil.copytree(scratch / "vllm", pristine / "vllm")
    assert run(target=scratch).returncode == 0
    out = tmp_path_factory.mktemp("series")
    assert regenerates_the_committed_series("vllm", pristine, scratch, out)
