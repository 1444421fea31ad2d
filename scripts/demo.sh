#!/usr/bin/env bash
# Set up (scripts/setup_env.sh), then run the demo: a short RAG workload through a real
# `vllm serve` on bench-llama with the chunk cache on (under 2 minutes on 2 CPU cores); it prints
# per request the documents, chunk cache hits/misses and TTFT, and writes demo-out/demo.png.
# Extra arguments go to `python -m benchmarks.demo` (--out DIR, --model DIR).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$repo/scripts/setup_env.sh"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "${CHUNK_CACHE_VENV:-$repo/.venv}/bin/python" -m benchmarks.demo "$@"
