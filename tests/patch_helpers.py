"""Shared helpers of the patch-series tests: run `apply_patches.sh` on scratch trees, read them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
APPLY = REPO / "scripts" / "apply_patches.sh"


def series(project: str) -> list[Path]:
    """The numbered patches of `patches/<project>/`, in order."""
    return sorted((REPO / "patches" / project).glob("[0-9][0-9][0-9][0-9]-*.patch"))


def touched_files(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)


def run(*args: str, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(APPLY), "--target", str(target), *args], capture_output=True, text=True)


def regenerated_series(project: str, pristine: Path, edited: Path, out: Path) -> dict[str, bytes]:
    """`regen_patches.py` over the committed series copied into `out` (it keeps their numbers):
    patch name -> bytes."""
    for p in series(project):
        shutil.copy2(p, out / p.name)
    regen = [sys.executable, str(REPO / "scripts" / "regen_patches.py"), project]
    paths = ["--pristine", str(pristine), "--edited", str(edited), "--out", str(out)]
    subprocess.run([*regen, *paths], check=True, capture_output=True)
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.patch"))}


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.py"))}
