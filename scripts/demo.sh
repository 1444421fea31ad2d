#!/usr/bin/env bash
# Set up (scripts/setup_env.sh), then run the demo on the tiny model. Extra arguments go to demo.py.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$repo/scripts/setup_env.sh"
exec "${CHUNK_CACHE_VENV:-$repo/.venv}/bin/python" "$repo/scripts/demo.py" "$@"
