#!/usr/bin/env bash
# The command batch for one session on an air-gapped CUDA machine (an H100 here: no internet,
# python3 with torch 2.11.0+cu130, triton and transformers; at most 64 MiB carried per call and
# 10 minutes per command). Each step is one call; outputs go to $OUT (default gpu-out/).
#
#   tools/gpu_session.sh receive    # once per bundle part carried in: keep it outside the tree
#   tools/gpu_session.sh install    # reassemble + install the bundle into .venv-gpu, patch vLLM,
#                                     # generate the models (tiny ones and bench-llama-1b)   ~3 min
#   tools/gpu_session.sh test       # GPU tests: chunk engines in bf16 with vLLM's defaults
#                                     # (tests/engine/test_gpu_engine.py), the Triton kernel tests  ~6 min
#   tools/gpu_session.sh bench      # bench_rag on bench-llama-1b, 8 x 512 + concurrency 16/64
#                                     # -> benchmarks/rag_h100.json/png   ~8 min
#   tools/gpu_session.sh bench-long # bench_rag --long (1/8/32 x 1,024) -> rag_h100_long.json/png
#   tools/gpu_session.sh all        # install, test, bench, bench-long (a machine with no limit)
#
# The tiny models have head_dim 32, which FlashAttention 3 runs through its 64 kernels; should it
# refuse them, `CHUNK_CACHE_GPU_ATTENTION_BACKEND=TRITON_ATTN tools/gpu_session.sh test`.
#
# Before: `python -m tools.gpu_bundle build` on a machine with the pip registry writes
# .gpu-bundle/parts/vllm-cuda-bundle.tar.xz.NN (<= 60 MiB each) and SHA256SUMS. Carry one part
# (plus SHA256SUMS) per call and run `receive` in each; the machine keeps its files only while it
# stays warm, so send the calls back to back (README, "On a GPU").
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
step=${1:?usage: gpu_session.sh receive|install|test|bench|bench-long|all}
store=${GPU_BUNDLE_STORE:-$HOME/.cache/vllm-ascend-chunk/gpu-bundle}
venv=${GPU_VENV:-$repo/.venv-gpu}
out=${OUT:-$repo/gpu-out}
models=${CHUNK_CACHE_MODELS_DIR:-$repo/.models}
mkdir -p "$out"
export CHUNK_CACHE_MODELS_DIR=$models PYTHONUNBUFFERED=1

receive() {
  mkdir -p "$store"
  local got=0
  for f in .gpu-bundle/parts/*; do
    [ -f "$f" ] || continue
    cp "$f" "$store/" && got=$((got + 1))
  done
  echo "receive: $got file(s) copied; the store now has:"
  ls -l "$store"
  (cd "$store" && grep -v ' vllm-cuda-bundle.tar.xz$' SHA256SUMS | while read -r sum name; do
     if [ -f "$name" ]; then echo "$sum  $name" | sha256sum -c --quiet && echo "  ok       $name"
     else echo "  missing  $name"; fi
   done)
}

do_install() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
  tools/gpu_bundle_install.sh "$store" "$venv" 2>&1 | tee "$out/install.log"
  "$venv/bin/python" scripts/make_tiny_models.py --out "$models"
  "$venv/bin/python" scripts/make_tiny_models.py --out "$models" --only bench-llama-1b
  "$venv/bin/python" -m pip list --format=freeze >"$out/pip-freeze.txt"
}

tests() {
  set +e
  CHUNK_CACHE_GPU_REPORT="$out/gpu_tests.json" "$venv/bin/python" -m pytest -p no:cacheprovider -q \
    -o addopts="-ra --timeout=900" --junitxml="$out/gpu_tests.xml" \
    tests/engine/test_gpu_engine.py tests/kernels/test_triton_kv_load.py \
    2>&1 | tee "$out/gpu_tests.log"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

bench() {
  # 8 x 512 (the CPU workload, 1B model in bf16), then 16 and 64 clients on fresh Zipf streams.
  "$venv/bin/python" -m benchmarks.bench_rag --model "$models/bench-llama-1b" --dtype bfloat16 \
    --pool-gb 8 --max-model-len 16384 --concurrency 16,64 --concurrency-requests 128 \
    --server-arg=--gpu-memory-utilization=0.85 --note "H100, gpu_session.sh bench" \
    --out benchmarks/rag_h100.json --log-dir /tmp/bench_rag_h100 2>&1 | tee "$out/bench.log"
  cp benchmarks/rag_h100.json benchmarks/rag_h100.png "$out/"
}

bench_long() {
  "$venv/bin/python" -m benchmarks.bench_rag --model "$models/bench-llama-1b" --dtype bfloat16 --long \
    --pool-gb 12 --server-arg=--gpu-memory-utilization=0.85 --note "H100, gpu_session.sh bench-long" \
    --out benchmarks/rag_h100_long.json --log-dir /tmp/bench_rag_h100_long 2>&1 | tee "$out/bench_long.log"
  cp benchmarks/rag_h100_long.json benchmarks/rag_h100_long.png "$out/"
}

case "$step" in
  receive) receive ;;
  install) do_install ;;
  test) tests ;;
  bench) bench ;;
  bench-long) bench_long ;;
  all) do_install; tests || true; bench; bench_long ;;
  *) echo "gpu_session: unknown step '$step'" >&2; exit 2 ;;
esac
