#!/usr/bin/env bash
# Set up (scripts/setup_env.sh), then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$repo/scripts/setup_env.sh"
cd "$repo"
exec "${CHUNK_CACHE_VENV:-$repo/.venv}/bin/python" -m pytest tests "$@"
