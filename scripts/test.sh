#!/usr/bin/env bash
# Set up (scripts/setup_env.sh), then run the whole test suite (what CI runs), or with --quick the
# edit-test loop: unit, patches, kernels, models and one engine smoke test. Extra arguments go to
# pytest. A skipped test fails (--strict-skips) unless it needs CUDA or an optional package.
# Test files run in CHUNK_CACHE_TEST_WORKERS (default 2) pytest-xdist processes, each file whole
# in one of them (its engines and servers are shared by its tests); 0 runs them in this process.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tests=(tests)
if [ "${1:-}" = --quick ]; then
  shift
  tests=(tests/unit tests/patches tests/kernels tests/models tests/engine/test_engine_smoke.py)
fi
"$repo/scripts/setup_env.sh"
cd "$repo"
workers=${CHUNK_CACHE_TEST_WORKERS:-2}
exec "${CHUNK_CACHE_VENV:-$repo/.venv}/bin/python" -m pytest --strict-skips \
  -n "$workers" --dist loadfile --no-loadscope-reorder "${tests[@]}" "$@"
