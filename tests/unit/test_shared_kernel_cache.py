"""tests/helpers/site/sitecustomize.py points torch inductor's kernel cache of every test process
at one folder, whatever vLLM writes to TORCHINDUCTOR_CACHE_DIR (its folder per compilation hash),
both where it is loaded before torch (a child process) and after (the pytest process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

SITE = REPO / "tests" / "helpers" / "site"

# What vLLM does before it compiles, then the folders inductor's code would use.
PROBE = """
import os, sys
{before}
from torch._inductor import codecache
from torch._inductor.runtime import cache_dir_utils, runtime_utils
{after}
os.environ["TORCHINDUCTOR_CACHE_DIR"] = {per_hash!r}
print(cache_dir_utils.cache_dir(), runtime_utils.cache_dir(), codecache.cache_dir())
"""


def folders(tmp_path: Path, *, loaded_first: bool, shared: bool = True) -> list[str]:
    site_import = "import tests.helpers.site.sitecustomize"
    code = PROBE.format(
        before="" if loaded_first else site_import,
        after=site_import if loaded_first else "",
        per_hash=str(tmp_path / "per-hash"),
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CHUNK_CACHE_TEST_INDUCTOR_CACHE", None)
    if shared:
        env["CHUNK_CACHE_TEST_INDUCTOR_CACHE"] = str(tmp_path / "shared")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()


def test_every_binding_of_cache_dir_answers_the_shared_folder(tmp_path: Path):
    shared = str(tmp_path / "shared")
    assert folders(tmp_path, loaded_first=False) == [shared] * 3
    assert folders(tmp_path, loaded_first=True) == [shared] * 3
    assert Path(shared).is_dir()


def test_without_the_variable_vllm_s_folder_stands(tmp_path: Path):
    assert folders(tmp_path, loaded_first=False, shared=False) == [str(tmp_path / "per-hash")] * 3
