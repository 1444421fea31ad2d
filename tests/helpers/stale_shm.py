"""Stale shared-memory segments of vLLM's CPU backend.

A TP or PP group of CPU workers shares a segment named `<port>-<group>-[<ranks>]-cpushm_<rank>`
in /dev/shm, where `<port>` is the port of the group's init method. A worker that is killed
(a server stopped with SIGKILL, a crashed test) leaves its segment behind, and a later group
that draws the same port fails to start (`create shm in SHMManager failed. errno: 17`). On a
machine that runs the suite again and again the leftovers pile up; a test run removes those
that no live process maps before it starts any engine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM_ROOT = Path("/dev/shm")
PATTERN = "*-cpushm_*"


def mapped_paths() -> set[str]:
    """Paths of the files that a live process maps (those /proc lets us read)."""
    paths: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # the process ended, or is not ours to read
            continue
        for line in lines:
            fields = line.split(None, 5)  # address, perms, offset, device, inode[, path]
            if len(fields) == 6:
                paths.add(fields[5].removesuffix(" (deleted)"))
    return paths


def remove_stale_segments(root: Path = SHM_ROOT, min_age_s: float = 60.0) -> list[str]:
    """Removes the CPU backend's segments under `root` that are ours, older than `min_age_s`
    (a group still being set up maps its segment within a second) and mapped by no live
    process; their names."""
    now = time.time()
    uid = os.getuid()
    candidates = []
    for path in root.glob(PATTERN):
        try:
            stat = path.stat()
        except OSError:
            continue
        if stat.st_uid == uid and now - stat.st_mtime > min_age_s:
            candidates.append(path)
    if not candidates:
        return []
    mapped = mapped_paths()
    removed = []
    for path in candidates:
        if str(path) in mapped:
            continue
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    return sorted(removed)
