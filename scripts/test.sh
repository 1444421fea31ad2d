#!/usr/bin/env bash
# Set up (scripts/setup_env.sh), then run the whole test suite (what CI runs), or with --quick the
# edit-test loop: unit, patches, kernels, models and one engine smoke test. Extra arguments go to
# pytest. A skipped test fails (--strict-skips) unless it needs CUDA or an optional package.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tests=(tests)
if [ "${1:-}" = --quick ]; then
  shift
  tests=(tests/unit tests/patches tests/kernels tests/models tests/engine/test_engine_smoke.py)
fi
"$repo/scripts/setup_env.sh"
cd "$repo"
exec "${CHUNK_CACHE_VENV:-$repo/.venv}/bin/python" -m pytest --strict-skips "${tests[@]}" "$@"
