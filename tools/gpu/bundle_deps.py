"""What the offline vLLM CUDA bundle holds beside vLLM (`python -m tools.gpu.bundle deps`).

vLLM's `Requires-Dist` closure (no extras) minus what the GPU image has
(`requirements/gpu-target-preinstalled.txt`) minus EXCLUDED, at the versions of
`requirements/cpu.txt` (the stack every test runs on), written to `requirements/gpu-bundle.txt`;
and the pip downloads for the target's platform (PIP_PLATFORM).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = (REPO / "patches" / "vllm" / "TARGET_VERSION").read_text().strip()
BUNDLE_REQS = REPO / "requirements" / "gpu-bundle.txt"
TARGET_LIST = REPO / "requirements" / "gpu-target-preinstalled.txt"
CPU_REQS = REPO / "requirements" / "cpu.txt"

# The target: CPython 3.12 on x86_64 Linux (glibc >= 2.28).
PIP_PLATFORM = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    *[a for n in (39, 35, 34, 31, 28, 27, 24, 17) for a in ("--platform", f"manylinux_2_{n}_x86_64")],
    "--platform",
    "manylinux2014_x86_64",
    "--platform",
    "manylinux1_x86_64",
]

# Requirements of vLLM 0.23.0 left out of the bundle, and why (the target may have some anyway).
EXCLUDED = {
    "torch": "preinstalled (2.11.0+cu130, the build vLLM 0.23.0 is compiled against)",
    "torchaudio": "preinstalled",
    "torchvision": "preinstalled",
    "triton": "preinstalled",
    "transformers": "preinstalled (5.17.0 there; vLLM accepts >=4.56, not 5.0-5.5.0)",
    "flashinfer-python": "FlashInfer attention/sampling: the selector skips a backend whose import "
    "fails (platforms/cuda.py get_valid_backends catches ImportError); the top-k/top-p sampler "
    "imports it on CUDA unless VLLM_USE_FLASHINFER_SAMPLER=0 (v1/sample/ops/topk_topp_sampler.py), "
    "which tools/gpu/session.sh sets (seen on an H200: without it every engine fails to start); "
    "FA3 and Triton attention need none of it",
    "flashinfer-cubin": "FlashInfer's precompiled kernels (see flashinfer-python)",
    "tilelang": "kernel DSL of sparse-MLA / DeepSeek kernels, imported lazily there",
    "nvidia-cudnn-frontend": "cuDNN attention/prefill for MLA on Blackwell",
    "nvidia-cutlass-dsl": "CuTe DSL: FlashAttention 4 (removed) and Blackwell kernels",
    "quack-kernels": "CuTe DSL kernels (Blackwell norms/GEMMs), imported lazily",
    "tokenspeed-mla": "MLA decode kernels (DeepSeek family)",
    "humming-kernels": "quantized-MoE kernels",
    "fastsafetensors": "optional loader (--load-format fastsafetensors)",
    "numba": "preinstalled (a different version; vLLM imports it only for n-gram speculative decoding)",
    # fastapi[standard]'s command-line tools: vLLM has its own CLI and never imports these.
    "fastapi-cli": "fastapi's CLI",
    "fastapi-cloud-cli": "fastapi's cloud CLI",
    "rich-toolkit": "fastapi-cli's UI",
    "rignore": "fastapi-cloud-cli",
    "sentry-sdk": "fastapi-cloud-cli",
    "fastar": "fastapi-cloud-cli",
}


def canon(name: str) -> str:
    """The normalised distribution name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run `cmd` (echoed first), raising on failure."""
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def target_names() -> set[str]:
    """The distributions the GPU image already has (canonical names)."""
    return {
        canon(line.strip())
        for line in TARGET_LIST.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }


def cpu_pins() -> dict[str, str]:
    """requirements/cpu.txt's pins: canonical name -> version."""
    pins = {}
    for line in CPU_REQS.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line.strip())
        if m:
            pins[canon(m.group(1))] = m.group(2)
    return pins


def download_vllm(dest: Path) -> Path:
    """The vLLM CUDA wheel for the target, downloaded into `dest` unless it is there already."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not found:
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-d",
                str(dest),
                *PIP_PLATFORM,
                f"vllm=={VLLM_VERSION}",
            ]
        )
        found = sorted(dest.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    return found[-1]


def wheel_metadata(wheel: Path) -> str:
    """The wheel's METADATA text."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


def requirements_of(metadata_text: str, extras: set[str]) -> list[Requirement]:
    """The `Requires-Dist` entries that apply on the target with `extras`."""
    from packaging.requirements import Requirement

    env = {
        "python_version": "3.12",
        "python_full_version": "3.12.3",
        "platform_machine": "x86_64",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    out = []
    for line in metadata_text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in {"", *extras}):
                out.append(req)
    return out


def closure(vllm_wheel: Path) -> dict[str, dict]:
    """vLLM's runtime requirements (no extras), recursively, minus the target's packages and
    EXCLUDED: name -> {version (from requirements/cpu.txt), needed_by, specifiers}."""
    from importlib import metadata

    have, pins = target_names(), cpu_pins()
    skip = {canon(n) for n in EXCLUDED}
    found: dict[str, dict] = {}
    expanded: dict[str, set[str]] = {}
    todo = [(req, "vllm") for req in requirements_of(wheel_metadata(vllm_wheel), set())]
    while todo:
        req, parent = todo.pop(0)
        name = canon(req.name)
        if name in skip or name in have:
            continue
        entry = found.setdefault(name, {"version": pins.get(name), "needed_by": [], "specifiers": []})
        if parent not in entry["needed_by"]:
            entry["needed_by"].append(parent)
        if str(req.specifier) and str(req.specifier) not in entry["specifiers"]:
            entry["specifiers"].append(str(req.specifier))
        new_extras = set(req.extras) - expanded.get(name, set())
        if name in expanded and not new_extras:
            continue
        expanded.setdefault(name, set()).update(req.extras)
        try:
            text = metadata.distribution(req.name).read_text("METADATA") or ""
        except metadata.PackageNotFoundError:
            entry["missing_locally"] = True
            continue
        if entry["version"] is None:
            entry["version"] = metadata.version(req.name)
        todo += [(r, name) for r in requirements_of(text, set(req.extras))]
    return found


def cmd_deps(args: argparse.Namespace) -> int:
    """Write requirements/gpu-bundle.txt; 1 if a distribution has no known version."""
    wheel = download_vllm(args.out / "download")
    deps = closure(wheel)
    lines = [
        f"# Generated by `python -m tools.gpu.bundle deps`: what vLLM {VLLM_VERSION} (CUDA wheel) needs",
        "# at run time that the GPU image (requirements/gpu-target-preinstalled.txt) lacks. Versions are",
        "# those of requirements/cpu.txt (the stack the CPU tests run on). Left out on purpose: see",
        "# EXCLUDED in tools/gpu/bundle_deps.py. Each line: the pin, then who requires it.",
    ]
    bad = []
    for name, e in sorted(deps.items()):
        if e["version"] is None:
            bad.append(name)
            continue
        lines.append(
            f"{name}=={e['version']}  # {', '.join(sorted(e['needed_by']))}"
            + (f" ({'; '.join(e['specifiers'])})" if e["specifiers"] else "")
        )
    BUNDLE_REQS.write_text("\n".join(lines) + "\n")
    print(f"wrote {BUNDLE_REQS.relative_to(REPO)}: {len(deps) - len(bad)} distributions")
    if bad:
        print(f"no version known for {bad}: pin them in requirements/cpu.txt or EXCLUDED", file=sys.stderr)
        return 1
    return 0
