"""The offline GPU bundle without a download: the slimmed wheel's contents and RECORD
(tools/gpu/bundle_build.py), and the committed dependency list against the CPU pins, the GPU
image's packages and the exclusions (tools/gpu/bundle_deps.py)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile
from pathlib import Path

from tools.gpu import bundle_build as gpu_bundle_build
from tools.gpu import bundle_deps as gpu_bundle_deps


def fake_wheel(path: Path) -> Path:
    files = {
        "vllm/__init__.py": b"",
        "vllm/_C.abi3.so": b"kept",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3",
    }
    for removed in gpu_bundle_build.REMOVED:
        files[removed + "x.py" if removed.endswith("/") else removed] = b"gone"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("vllm-0.23.0.dist-info/METADATA", b"Name: vllm\nVersion: 0.23.0\n")
        z.writestr("vllm-0.23.0.dist-info/RECORD", "".join(f"{n},,\n" for n in files))
    return path


def test_slim_wheel_drops_the_removed_files_and_rewrites_record(tmp_path: Path):
    src = fake_wheel(tmp_path / "vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl")
    out = tmp_path / "out"
    out.mkdir()
    info = gpu_bundle_build.slim_wheel(src, out)
    assert len(info["removed"]) == len(gpu_bundle_build.REMOVED)
    with zipfile.ZipFile(out / src.name) as z:
        names = set(z.namelist())
        assert "vllm/_C.abi3.so" in names and "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" in names
        assert not any(gpu_bundle_build.removed(n) for n in names)
        rows = list(csv.reader(io.StringIO(z.read("vllm-0.23.0.dist-info/RECORD").decode())))
        assert {r[0] for r in rows} == names
        for name, digest, size in rows:
            if name.endswith("RECORD"):
                continue
            data = z.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={want}", len(data))


def test_dependency_list_matches_the_cpu_pins_and_leaves_out_the_image_and_exclusions():
    pins = gpu_bundle_deps.cpu_pins()
    have = gpu_bundle_deps.target_names()
    excluded = {gpu_bundle_deps.canon(n) for n in gpu_bundle_deps.EXCLUDED}
    listed = {}
    for line in gpu_bundle_deps.BUNDLE_REQS.read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if spec:
            name, version = spec.split("==")
            listed[gpu_bundle_deps.canon(name)] = version
    assert listed, "requirements/gpu-bundle.txt is empty"
    for name, version in listed.items():
        assert name not in have and name not in excluded, name
        assert pins.get(name, version) == version, f"{name}: {version} here, {pins[name]} in cpu.txt"
    for needed in ("pydantic", "fastapi", "openai", "pyzmq", "msgspec", "blake3", "xgrammar"):
        assert needed in listed, needed
