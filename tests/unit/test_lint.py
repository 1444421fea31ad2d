"""Style is checked, never reviewed: `ruff check` and `ruff format --check` (ruff.toml)."""

import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(command):
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, str(REPO)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
