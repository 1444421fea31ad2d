"""The test run's clean-up of vLLM CPU shared-memory segments left by killed workers
(`tests/helpers/stale_shm.py`): only old segments that no live process maps go."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from tests.helpers.stale_shm import remove_stale_segments


def segment(root: Path, name: str, age_s: float) -> Path:
    path = root / name
    path.write_bytes(b"\0" * 4096)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_only_old_unmapped_segments_are_removed(tmp_path: Path):
    stale = segment(tmp_path, "40593-tp:0-[0-1]-cpushm_0", 3600)
    young = segment(tmp_path, "40594-tp:0-[0-1]-cpushm_0", 1)
    in_use = segment(tmp_path, "40595-pp:0-[0-1]-cpushm_1", 3600)
    other = segment(tmp_path, "psm_2e9ec814", 3600)
    with in_use.open("r+b") as f, mmap.mmap(f.fileno(), 4096):
        removed = remove_stale_segments(tmp_path)
    assert removed == [stale.name]
    assert not stale.exists() and young.exists() and in_use.exists() and other.exists()
