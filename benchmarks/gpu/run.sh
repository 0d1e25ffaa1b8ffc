#!/usr/bin/env bash
# trainkit on the borrowed GPU machine (one H200; torch 2.11 + CUDA 13.0 for python3, cmake and
# ninja; no internet, nothing installable), in about 8 minutes at most:
#   1. builds gpu_check against that machine's torch
#      (python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') in build-gpu/,
#   2. gpu_check: BERT-base, sequence 128: step time, TFLOP/s against a bf16 matrix-product peak
#      it measures, peak GPU memory, host syncs per step, for FP32, BF16, FP16Dynamic (and FP16
#      with master weights where trainkit has them), trainkit and the hand-written LibTorch loop,
#   3. the Python AMP loop (benchmarks/compare/loop.py --device cuda) on the same model,
#   4. NCCL at world size 1 (where include/trainkit/distributed.hpp exists): trainkit's process-
#      group start-up and first all-reduce, a DataParallel trainer against one process, and a
#      save after step 6 loaded into a fresh DataParallel trainer; torch.distributed's start-up,
#   5. builds and runs the unit tests (trainkit_tests; CUDA cases run where a GPU is present).
# Each step has a time limit out of one budget (TRAINKIT_GPU_BUDGET seconds, default 460); a
# step that fails or runs out is reported and the next one runs. The report (markdown) goes to
# stdout and to $OUT/gpu_report.md (or build-gpu/gpu_report.md without $OUT).
#
#   benchmarks/gpu/run.sh --pack-deps   # here, before borrowing the machine: copies the header-
#                                       # only dependencies it may lack (nlohmann-json, doctest,
#                                       # gloo) into build-gpu-deps/; carry that path with the tree
#   benchmarks/gpu/run.sh               # on the GPU machine
#   benchmarks/gpu/run.sh --dry-run     # without a GPU: builds gpu_check in build/ (scripts/build)
#                                       # and runs every step's code on the CPU, small
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODE="${1:-run}"
DEPS="$ROOT/build-gpu-deps"
START=$(date +%s)
BUDGET="${TRAINKIT_GPU_BUDGET:-$([[ "$MODE" == --dry-run ]] && echo 1800 || echo 460)}"
left() { echo $((BUDGET - ($(date +%s) - START))); }
FAILED=()  # the steps that failed; the report's last line is PASS or them
say() { echo "$*" | tee -a "$REPORT"; }
# step NAME SECONDS COMMAND...: runs COMMAND under the smaller of SECONDS and the budget left.
step() {
  local name="$1" limit="$2"
  shift 2
  local l
  l=$(left)
  ((l < limit)) && limit=$l
  if ((limit < 10)); then
    FAILED+=("$name (no time left)")
    say "- $name: SKIPPED (the time budget is spent)"
    return 1
  fi
  local t0 rc
  t0=$(date +%s)
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  local took=$(($(date +%s) - t0))
  if ((rc == 0)); then
    echo "[gpu] $name: ok (${took} s)" >&2
  else
    FAILED+=("$name")
    say "- $name: FAILED (exit $rc after ${took} s; limit ${limit} s), last lines:"
    tail -n 15 "$LOGS/$name.log" | sed 's/^/      /' | tee -a "$REPORT"
  fi
  return $rc
}

if [[ "$MODE" == "--pack-deps" ]]; then
  rm -rf "$DEPS" && mkdir -p "$DEPS/include" "$DEPS/share/cmake" "$DEPS/lib/cmake"
  for h in nlohmann doctest gloo; do
    [[ -d /usr/include/$h ]] && cp -r "/usr/include/$h" "$DEPS/include/"
  done
  [[ -d /usr/share/cmake/nlohmann_json ]] && cp -r /usr/share/cmake/nlohmann_json "$DEPS/share/cmake/"
  [[ -d /usr/lib/cmake/doctest ]] && cp -r /usr/lib/cmake/doctest "$DEPS/lib/cmake/"
  du -sh "$DEPS"
  echo "carry build-gpu-deps with the working tree to the GPU machine"
  exit 0
fi

if [[ "$MODE" == "--dry-run" ]]; then
  B="${TRAINKIT_BUILD_DIR:-$ROOT/build}"
  PY="$ROOT/.venv/bin/python"
  DEVICE=cpu
else
  B="$ROOT/build-gpu"
  PY=python3
  DEVICE=cuda
fi
mkdir -p "$B"
LOGS="$B/gpu_logs"
mkdir -p "$LOGS"
REPORT="${OUT:-$B}/gpu_report.md"
: >"$REPORT"

say "## GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'), mode ${MODE})"
say ""
say "Machine: $(hostname), $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
say "Python torch: $($PY -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())' 2>&1 | tail -1)"
say ""

# --- 1. build ----------------------------------------------------------------------------------
if [[ "$MODE" == "--dry-run" ]]; then
  bash -n "${BASH_SOURCE[0]}" && say "- bash -n: ok"
  step build 900 env TRAINKIT_JOBS="${TRAINKIT_JOBS:-1}" TRAINKIT_BUILD_DIR="$B" \
    "$ROOT/scripts/build" --target benchmark_gpu_check
else
  # Fail fast: nlohmann-json is required, doctest only for the unit tests. Neither can be
  # installed on the GPU machine: --pack-deps here copies them into build-gpu-deps/.
  if [[ ! -d "$DEPS/include/nlohmann" && ! -d /usr/include/nlohmann ]]; then
    say "FAIL: nlohmann-json is neither packed ($DEPS) nor installed: run 'benchmarks/gpu/run.sh --pack-deps' before borrowing the machine and carry build-gpu-deps"
    exit 1
  fi
  HAVE_DOCTEST=OFF
  [[ -d "$DEPS/include/doctest" || -d /usr/include/doctest ]] && HAVE_DOCTEST=ON
  TORCH_PREFIX="$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')"
  prefix="$TORCH_PREFIX"
  cxxflags=""
  if [[ -d "$DEPS" ]]; then
    prefix="$TORCH_PREFIX;$DEPS"
    cxxflags="-isystem $DEPS/include"
  fi
  # The wheel ships nccl.h (nvidia-nccl) outside LibTorch's include path; distributed.hpp uses
  # NCCL only where it finds that header.
  NCCL_INC="$($PY -c 'import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], "include"))' 2>/dev/null || true)"
  [[ -n "$NCCL_INC" && -f "$NCCL_INC/nccl.h" ]] && cxxflags="$cxxflags -isystem $NCCL_INC"
  flags=()
  [[ -n "$cxxflags" ]] && flags=(-DCMAKE_CXX_FLAGS="$cxxflags")
  step configure 120 cmake -S "$ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" -DCMAKE_PREFIX_PATH="$prefix" \
    -DTRAINKIT_BUILD_EXAMPLES=OFF -DTRAINKIT_BUILD_TOOLS=OFF -DTRAINKIT_WITH_YAML=OFF \
    -DTRAINKIT_BUILD_TESTS="$HAVE_DOCTEST" \
    "${flags[@]}"
  step build 240 cmake --build "$B" --target benchmark_gpu_check -j "$(nproc)"
fi

# --- 2. gpu_check ------------------------------------------------------------------------------
say ""
say "### trainkit and the hand-written LibTorch loop (gpu_check)"
say ""
if [[ "$MODE" == "--dry-run" ]]; then
  step gpu_check 300 "$B/benchmarks/gpu/gpu_check" --dry-run --precisions fp32,bf16
else
  step gpu_check 150 "$B/benchmarks/gpu/gpu_check"
fi
[[ -f "$LOGS/gpu_check.log" ]] && grep -v "^\[W" "$LOGS/gpu_check.log" | tee -a "$REPORT"

# --- 3. the Python loop -------------------------------------------------------------------------
say ""
say "### The Python AMP loop on the same model (loop.py, torch.autocast + GradScaler)"
say ""
say "Same model, weights and data as gpu_check: the FP32 losses should equal its rows (to GPU rounding)."
say ""
say "| precision | step ms (median) | peak GPU memory MiB | first / last loss |"
say "|---|---|---|---|"
if [[ "$MODE" == "--dry-run" ]]; then
  pyargs=(--device cpu --model bert-tiny --micro-batch 1 --seq 8 --windows 2 --warmup 1)
  precisions="fp32"
else
  pyargs=(--device cuda --model bert-base --micro-batch 32 --windows 10 --warmup 3 --threads 8)
  precisions="fp32 bf16 fp16"
fi
for p in $precisions; do
  if step "python_$p" 60 "$PY" "$ROOT/benchmarks/compare/loop.py" "${pyargs[@]}" --precision "$p"; then
    tail -n 1 "$LOGS/python_$p.log" | "$PY" -c '
import json, statistics, sys
r = json.loads(sys.stdin.read())
print("| %s | %.2f | %.0f | %.4f / %.4f |" % (r["precision"], statistics.median(r["window_ms"]),
      r.get("gpu_peak_mib", 0.0), r["losses"][0], r["losses"][-1]))' | tee -a "$REPORT"
  fi
done

# --- 4. NCCL: start-up, DataParallel, resume ----------------------------------------------------
say ""
say "### NCCL at world size 1: process-group start-up, DataParallel through a trainer, resume"
say ""
if [[ ! -f "$ROOT/include/trainkit/distributed.hpp" ]]; then
  say "- trainkit: SKIPPED, include/trainkit/distributed.hpp is not in this tree"
else
  nccl_args=()
  [[ "$MODE" == "--dry-run" ]] && nccl_args=(--dry-run)
  if step build_nccl 180 cmake --build "$B" --target benchmark_gpu_nccl_startup -j "$(nproc)"; then
    step nccl_startup 90 "$B/benchmarks/gpu/nccl_startup" "${nccl_args[@]}"
    grep -E "^(- |PASS|FAIL)" "$LOGS/nccl_startup.log" | tee -a "$REPORT"
  fi
fi
if [[ "$MODE" == "--dry-run" ]]; then
  say "- torch.distributed: (dry run) skipped, no GPU"
elif step nccl_python 60 "$PY" -c '
import os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1")
x = torch.ones(1 << 20, device="cuda"); torch.cuda.synchronize()
t0 = time.perf_counter()
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
t1 = time.perf_counter()
dist.all_reduce(x); torch.cuda.synchronize()
t2 = time.perf_counter()
print("torch.distributed NCCL, world size 1: init_process_group %.1f ms, first all_reduce %.1f ms" % ((t1 - t0) * 1e3, (t2 - t1) * 1e3))
dist.destroy_process_group()'; then
  tail -n 1 "$LOGS/nccl_python.log" | sed 's/^/- /' | tee -a "$REPORT"
fi

# --- 5. unit tests ------------------------------------------------------------------------------
say ""
say "### Unit tests"
say ""
if [[ "$MODE" == "--dry-run" ]]; then
  say "- (dry run) would build trainkit_tests in $B and run: ctest --test-dir $B -L unit -j 4"
elif [[ "$HAVE_DOCTEST" != ON ]]; then
  say "- SKIPPED: doctest is neither packed nor installed (run --pack-deps here to include the unit tests)"
else
  if step build_tests 330 cmake --build "$B" --target trainkit_tests -j "$(nproc)"; then
    OMP_NUM_THREADS=4 step unit_tests 150 ctest --test-dir "$B" -L unit -j 4 --timeout 120 --output-on-failure
    grep -E "tests passed|tests failed|Skipped|Failed|\*\*\*" "$LOGS/unit_tests.log" | tail -n 20 | sed 's/^/    /' | tee -a "$REPORT"
  fi
fi
say ""
say "Total $(($(date +%s) - START)) s. Logs: $LOGS"
if ((${#FAILED[@]} > 0)); then
  say "FAIL: ${FAILED[*]}"
  exit 1
fi
say "PASS"
