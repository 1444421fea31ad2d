"""`vllm-chunk-cache-patch`: the patch series for a pip-installed package, without the repository.

    vllm-chunk-cache-patch [--check | --revert] [--python PY | --target DIR]

It runs the package's own copy of `scripts/apply_patches.sh` on the series it was built with
(`setup.py` puts both under `vllm_ascend_chunk/_series/`; an editable install uses the checkout's).
Without `--python` or `--target`, it patches the vLLM of the interpreter it runs in. Options and
exit status are `apply_patches.sh`'s.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path("scripts") / "apply_patches.sh"


def series_root() -> Path:
    """The folder holding `scripts/apply_patches.sh` and `patches/`: in the installed package,
    or the source checkout the package is imported from (editable install)."""
    package = Path(__file__).resolve().parents[1]
    for root in (package / "_series", package.parent):
        if (root / SCRIPT).is_file() and (root / "patches").is_dir():
            return root
    raise SystemExit(f"vllm-chunk-cache-patch: no patch series next to {package} (a broken install?)")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not {"--python", "--target", "-h", "--help"} & set(args):
        args = ["--python", sys.executable, *args]
    return subprocess.call(["bash", str(series_root() / SCRIPT), *args])


if __name__ == "__main__":
    sys.exit(main())
