"""The suite's guard (tests/conftest.py): with --strict-skips, as scripts/test.sh runs it, a test
skipped for want of two cores, a store binary or a model fails loudly; only tests marked `cuda`
or `optional` and those skipped for "no CUDA" may skip. Every run ends with its wall time per test
directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

CASES = """
import pytest

@pytest.mark.skipif(True, reason="two workers on CPU bind one core each")
def test_two_cores():
    pass

def test_store_binary():
    pytest.skip("Mooncake Store is not installed")

@pytest.mark.skipif(True, reason="no CUDA here: run by another test")
def test_no_cuda():
    pass

@pytest.mark.cuda
@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_marked_cuda():
    pass

@pytest.mark.optional
def test_optional_package():
    pytest.skip("somepackage is not installed")

def test_runs():
    pass
"""


def run_cases(tmp_path: Path, *options: str) -> str:
    """CASES under this repository's pytest.ini and tests/conftest.py (as a plugin): the summary."""
    (tmp_path / "test_cases.py").write_text(CASES)
    cmd = [sys.executable, "-m", "pytest", "-c", str(REPO / "pytest.ini")]
    cmd += ["-p", "tests.conftest", "-p", "no:cacheprovider", "-q", *options, str(tmp_path)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120).stdout


def test_strict_skips_fail_the_run_for_anything_but_cuda_and_optional_packages(tmp_path: Path):
    out = run_cases(tmp_path, "--strict-skips")
    assert "test_cases.py::test_two_cores: two workers on CPU bind one core each" in out, out
    assert "test_cases.py::test_store_binary: Mooncake Store is not installed" in out, out
    assert "1 failed, 1 passed, 3 skipped, 1 error" in out, out
    assert "wall time per test directory" in out and "s  in all" in out, out


def test_without_the_option_skips_stay_skips(tmp_path: Path):
    out = run_cases(tmp_path)
    assert "1 passed, 5 skipped" in out, out
    assert "SKIPPED IN A STRICT RUN" not in out, out
