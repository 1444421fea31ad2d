#!/usr/bin/env bash
# Install the offline vLLM CUDA bundle (tools/gpu/bundle.py build) on an air-gapped GPU machine
# whose python3 already has torch (2.11.0+cu130), triton and transformers; then this package in
# editable mode and the vLLM patch series. Nothing is fetched from the network.
#
#   tools/gpu/bundle_install.sh PARTS_DIR [VENV]
#
# PARTS_DIR holds vllm-cuda-bundle.tar.xz.NN and SHA256SUMS. VENV (default: <repo>/.venv-gpu) is
# created with the target's python3 (PYTHON=...) and layered on that interpreter's site-packages
# by a .pth file, so torch, triton, transformers and everything else preinstalled come from there;
# `pip install --no-index --no-deps` puts into VENV only the bundled wheels whose distribution is
# missing there or fails a version requirement of vLLM or of another bundled wheel.
# A second run reinstalls nothing that is already there. Exit status 0 when `import vllm` works,
# the patch series is applied and CUDA is visible to torch. BUNDLE_DRY_RUN=1: check, unpack and
# list the wheels it would install, then stop.
set -euo pipefail

parts=${1:?usage: gpu_bundle_install.sh PARTS_DIR [VENV]}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${2:-$repo/.venv-gpu}
python=${PYTHON:-python3}
work=${BUNDLE_WORK:-${TMPDIR:-/tmp}/vllm-cuda-bundle}
archive=vllm-cuda-bundle.tar.xz
start=$(date +%s)

echo "bundle: checking the parts in $parts"
(cd "$parts" && grep -v " $archive\$" SHA256SUMS | sha256sum -c --quiet)
mkdir -p "$work"
cat "$parts/$archive".[0-9][0-9] >"$work/$archive"
(cd "$work" && grep " $archive\$" "$(cd "$parts" && pwd)/SHA256SUMS" | sha256sum -c --quiet)
rm -rf "$work/stage" && mkdir -p "$work/stage"
# Python's lzma: no dependence on an xz binary on the target.
"$python" - "$work/$archive" "$work/stage" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as tar:
    tar.extractall(sys.argv[2], filter="data")
PY
rm -f "$work/$archive"
echo "bundle: unpacked in $(($(date +%s) - start)) s"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
base_site=$("$python" -c 'import site; print("\n".join(site.getsitepackages()))')
venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# After the venv's own site-packages: the bundle's wheels shadow, the base environment fills in.
printf '%s\n' $base_site >"$venv_site/_base_environment.pth"

# The wheels to install: a distribution is taken from the base environment when it is there and
# satisfies every requirement on it (vLLM's and the bundled wheels' Requires-Dist).
mapfile -t wanted < <("$venv/bin/python" - "$work/stage/wheels" <<'PY'
import sys, zipfile
from importlib import metadata
from pathlib import Path
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

wheels = {}
for w in sorted(Path(sys.argv[1]).glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(w.name)
    wheels[canonicalize_name(name)] = (w, version)
env = {"extra": ""}
specs = {}
for name, (w, _) in wheels.items():
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or r.marker.evaluate(env):
                specs.setdefault(canonicalize_name(r.name), []).append(r.specifier)
for name, (w, version) in wheels.items():
    try:
        have = Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        print(w)
        continue
    if name == "vllm" or any(not s.contains(have, prereleases=True) for s in specs.get(name, [])):
        if have != version:
            print(w)
PY
)
if [ -n "${BUNDLE_DRY_RUN:-}" ]; then
  echo "bundle: would install ${#wanted[@]} wheels into $venv:"
  printf '  %s\n' "${wanted[@]##*/}"
  exit 0
fi
if [ "${#wanted[@]}" -gt 0 ]; then
  echo "bundle: installing ${#wanted[@]} wheels into $venv"
  "$venv/bin/python" -m pip install --quiet --no-index --no-deps --no-warn-conflicts "${wanted[@]}"
else
  echo "bundle: every bundled distribution is already there"
fi
"$venv/bin/python" -m pip install --quiet --no-index --no-deps --no-build-isolation --use-pep517 --no-warn-conflicts -e "$repo"

if ! command -v patch >/dev/null; then
  deb=$(ls "$work"/stage/debs/patch_*.deb 2>/dev/null | head -1 || true)
  [ -n "$deb" ] || { echo "bundle: no 'patch' program and no patch .deb in the bundle" >&2; exit 1; }
  mkdir -p "$work/patch-root"
  if command -v dpkg >/dev/null; then dpkg -x "$deb" "$work/patch-root"
  else (cd "$work/patch-root" && ar x "$deb" data.tar.xz && tar -xJf data.tar.xz); fi
  export PATH="$work/patch-root/usr/bin:$PATH"
  echo "bundle: using patch from $deb"
fi
"$repo/scripts/apply_patches.sh" --python "$venv/bin/python"

"$venv/bin/python" - <<'PY'
import torch, vllm, vllm_ascend_chunk
from vllm.platforms import current_platform
print(f"bundle: vllm {vllm.__version__}, torch {torch.__version__}, platform {current_platform.device_name}, "
      f"CUDA {torch.cuda.is_available()} ({torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'})")
from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
print(f"bundle: FlashAttention version for this GPU: {get_flash_attn_version()}")
assert torch.cuda.is_available(), "torch sees no CUDA device"
PY
echo "bundle: ready in $(($(date +%s) - start)) s; use $venv/bin/python"
