import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(REPO)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
