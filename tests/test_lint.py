"""Style is checked, never reviewed: `ruff check` and `ruff format --check` (ruff.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(command):
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, str(REPO)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
