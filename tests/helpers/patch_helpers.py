"""Shared helpers of the patch-series tests: run `apply_patches.sh` on scratch trees, read them."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

APPLY = REPO / "scripts" / "apply_patches.sh"


def series(project: str) -> list[Path]:
    """The numbered patches of `patches/<project>/`, in order."""
    return sorted((REPO / "patches" / project).glob("[0-9][0-9][0-9][0-9]-*.patch"))


def touched_files(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)


def copy_installed_vllm(into: Path) -> None:
    """The installed vLLM's files that the vLLM series touches, plus `_version.py`, copied into `into`."""
    installed = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]).parent
    for rel in {"vllm/_version.py", *(f for p in series("vllm") for f in touched_files(p))}:
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(installed / rel, into / rel)


def run(*args: str, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(APPLY), "--target", str(target), *args], capture_output=True, text=True)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.py"))}


def regenerates_the_committed_series(project: str, pristine: Path, edited: Path, out: Path) -> bool:
    """Whether `tools/dev/regen_patches.py` writes the committed `patches/<project>/` byte for byte into
    `out` (seeded with the committed patches: their numbering is kept)."""
    for p in series(project):
        shutil.copy2(p, out / p.name)
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "dev" / "regen_patches.py"),
            project,
            "--pristine",
            str(pristine),
            "--edited",
            str(edited),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.patch"))} == {
        p.name: p.read_bytes() for p in series(project)
    }
