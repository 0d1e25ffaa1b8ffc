#!/usr/bin/env bash
# trainkit on the borrowed GPU machine (one H100 or H200, whichever is lent; torch 2.11 + CUDA 13.0
# for python3, cmake and ninja; no internet, nothing installable). The exact device call, prepared
# here first:
#
#   benchmarks/gpu/run.sh --pack-deps      # here: nlohmann-json and gloo into build-gpu-deps/
#   benchmarks/gpu/run.sh --dry-run        # here: every step below on the CPU, small (must PASS)
#   device run: command="benchmarks/gpu/run.sh", carry=["build-gpu-deps"], timeout_s=420
#
# The report comes back as files_at/gpu_report.md (also on stdout; its last line is PASS or
# "FAIL: <steps>"), every step's log as files_at/gpu_logs.tar.gz. Steps:
#   1. configures build-gpu/ against that machine's torch
#      (python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'), tests, examples and
#      tools off, and builds gpu_check and nccl_startup in one ninja run,
#   2. gpu_check: BERT-base, sequence 128: step time, TFLOP/s against a bf16 matrix-product peak
#      it measures, peak GPU memory, bytes per parameter, host syncs per step, for FP32, BF16,
#      FP16Dynamic (and FP16 with master weights), trainkit and the hand-written LibTorch loop;
#      then the resume check (deterministic algorithms on), the memory check and tk::recompute
#      on CUDA (the unit tests' CUDA case),
#   3. the Python AMP loop (benchmarks/compare/loop.py --device cuda) on the same model; its FP32
#      losses must equal gpu_check's trainkit FP32 losses (relative 1e-5 at the first window,
#      2e-4 after: the same start, then the kernels' rounding apart),
#   4. NCCL at world size 1: trainkit's process-group start-up and first all-reduce (10 s at
#      most), a DataParallel trainer against one process, and a save after step 6 loaded into a
#      fresh DataParallel trainer; then ZeRO stage 2 cut as a sharded run (shard_at_world_size_one):
#      reduce-scatter with PREMUL_SUM, all-gather, gather to rank 0, the released gradient and
#      hook-launched buckets on NCCL, counted and asserted, against one process and resumed;
#      then ZeRO stage 3 the same way (6 units through tk::unit, one gathered ahead: unit
#      all-gathers, per-unit reduce-scatters, released buffers, the held bytes against the
#      prediction); then stage 3 in half precision (MasterWeights<FP16Dynamic>, BF16): the
#      allocator's peak in a forward and backward against the prediction, one window's
#      collectives counted, a checkpoint set written in the background loaded back bit-equal;
#      torch.distributed's start-up for reference.
# The unit tests are not run there: they run in CI on the CPU, building them would cost most of
# the machine's time, and their one CUDA case (test_recompute.cpp's "recompute on CUDA") runs in
# gpu_check, on the same model and code (tests/support/recompute_model.hpp). Each step has a time limit out of one budget (TRAINKIT_GPU_BUDGET
# seconds, default 360, so that a rerun fits in the 15 minutes a task is lent); a step that fails
# or runs out is reported and the next one runs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODE="${1:-run}"
DEPS="$ROOT/build-gpu-deps"
START=$(date +%s)
BUDGET="${TRAINKIT_GPU_BUDGET:-$([[ "$MODE" == --dry-run ]] && echo 1800 || echo 360)}"
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
  for h in nlohmann gloo; do
    [[ -d /usr/include/$h ]] && cp -r "/usr/include/$h" "$DEPS/include/"
  done
  [[ -d /usr/share/cmake/nlohmann_json ]] && cp -r /usr/share/cmake/nlohmann_json "$DEPS/share/cmake/"
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
# Every step's log comes back with the report (at most 8 files come back from the machine).
[[ -n "${OUT:-}" ]] && trap 'tar -C "$B" -czf "$OUT/gpu_logs.tar.gz" gpu_logs gpu_losses.json 2>/dev/null' EXIT

say "## GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'), mode ${MODE})"
say ""
say "Machine: $(hostname), $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
say "Python torch: $($PY -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())' 2>&1 | tail -1)"
say ""

# --- 1. build ----------------------------------------------------------------------------------
TARGETS=(benchmark_gpu_check)
[[ -f "$ROOT/include/trainkit/parallel/data_parallel.hpp" ]] && TARGETS+=(benchmark_gpu_nccl_startup)
if [[ "$MODE" == "--dry-run" ]]; then
  bash -n "${BASH_SOURCE[0]}" && say "- bash -n: ok"
  step build 900 env TRAINKIT_JOBS="${TRAINKIT_JOBS:-2}" TRAINKIT_BUILD_DIR="$B" \
    "$ROOT/scripts/build" --target "${TARGETS[@]}"
else
  # Fail fast: nlohmann-json cannot be installed on the GPU machine: --pack-deps here copies it
  # (and gloo's headers, for nccl_startup) into build-gpu-deps/.
  if [[ ! -d "$DEPS/include/nlohmann" && ! -d /usr/include/nlohmann ]]; then
    say "FAIL: nlohmann-json is neither packed ($DEPS) nor installed: run 'benchmarks/gpu/run.sh --pack-deps' before borrowing the machine and carry build-gpu-deps"
    exit 1
  fi
  # LibTorch's CUDA package needs the CUDA toolkit (nvcc) at configure time.
  if ! command -v nvcc >/dev/null 2>&1; then
    [[ -x /usr/local/cuda/bin/nvcc ]] && export PATH="/usr/local/cuda/bin:$PATH"
  fi
  if ! command -v nvcc >/dev/null 2>&1; then
    say "FAIL: no nvcc (neither on PATH nor /usr/local/cuda/bin): LibTorch's CUDA package cannot be configured"
    exit 1
  fi
  TORCH_PREFIX="$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')"
  prefix="$TORCH_PREFIX"
  cxxflags=""
  if [[ -d "$DEPS" ]]; then
    prefix="$TORCH_PREFIX;$DEPS"
    cxxflags="-isystem $DEPS/include"
  fi
  # The wheel ships nccl.h (nvidia-nccl) outside LibTorch's include path; data_parallel.hpp uses
  # NCCL only where it finds that header.
  NCCL_INC="$($PY -c 'import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], "include"))' 2>/dev/null || true)"
  if [[ -n "$NCCL_INC" && -f "$NCCL_INC/nccl.h" ]]; then
    cxxflags="$cxxflags -isystem $NCCL_INC"
  elif [[ ! -f /usr/local/cuda/include/nccl.h && ! -f /usr/include/nccl.h ]]; then
    say "- NOTE: no nccl.h (neither the wheel's nvidia.nccl nor the system's): nccl_startup builds without NCCL and will fail"
  fi
  flags=()
  [[ -n "$cxxflags" ]] && flags=(-DCMAKE_CXX_FLAGS="$cxxflags")
  step configure 90 cmake -S "$ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" -DCMAKE_PREFIX_PATH="$prefix" \
    -DTRAINKIT_BUILD_TESTS=OFF -DTRAINKIT_BUILD_EXAMPLES=OFF -DTRAINKIT_BUILD_TOOLS=OFF \
    -DTRAINKIT_WITH_YAML=OFF ${flags[@]+"${flags[@]}"}
  step build 200 cmake --build "$B" --target "${TARGETS[@]}" -j "$(nproc)"
fi

# --- 2. gpu_check ------------------------------------------------------------------------------
say ""
say "### trainkit and the hand-written LibTorch loop (gpu_check)"
say ""
rm -f "$B/gpu_losses.json"  # only this run's losses are compared
if [[ "$MODE" == "--dry-run" ]]; then
  step gpu_check 300 "$B/benchmarks/gpu/gpu_check" --dry-run --losses-json "$B/gpu_losses.json"
else
  # cuBLAS's deterministic workspace for the resume check (deterministic algorithms on there).
  step gpu_check 150 env CUBLAS_WORKSPACE_CONFIG=:4096:8 "$B/benchmarks/gpu/gpu_check" \
    --losses-json "$B/gpu_losses.json"
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
python_fp32_ok=0
for p in $precisions; do
  if step "python_$p" 60 "$PY" "$ROOT/benchmarks/compare/loop.py" "${pyargs[@]}" --precision "$p"; then
    tail -n 1 "$LOGS/python_$p.log" | "$PY" -c '
import json, statistics, sys
r = json.loads(sys.stdin.read())
print("| %s | %.2f | %.0f | %.4f / %.4f |" % (r["precision"], statistics.median(r["window_ms"]),
      r.get("gpu_peak_mib", 0.0), r["losses"][0], r["losses"][-1]))' | tee -a "$REPORT"
    [[ "$p" == fp32 ]] && python_fp32_ok=1
  fi
done
# The Python FP32 losses against gpu_check's trainkit FP32 losses, window by window (warm-up
# windows included in both).
if ((python_fp32_ok)) && [[ -f "$B/gpu_losses.json" ]]; then
  compared="$(tail -n 1 "$LOGS/python_fp32.log" | "$PY" -c '
import json, sys
py = json.loads(sys.stdin.read())["losses"]
tk = json.load(open(sys.argv[1])).get("trainkit/fp32", [])
bad = [] if len(py) == len(tk) and py else ["%d Python windows, %d trainkit windows" % (len(py), len(tk))]
for i, (a, b) in enumerate(zip(py, tk)):
    tol = 1e-5 if i == 0 else 2e-4
    if not abs(a - b) <= tol * abs(b):
        bad.append("window %d: Python %.7f, trainkit %.7f (relative %.1e > %.0e)" % (i, a, b, abs(a - b) / abs(b), tol))
worst = max((abs(a - b) / abs(b) for a, b in zip(py, tk)), default=float("nan"))
print("- FP32 losses, Python against trainkit: %d windows, largest relative difference %.1e%s"
      % (len(py), worst, "" if not bad else "; " + "; ".join(bad[:3])))
sys.exit(1 if bad else 0)' "$B/gpu_losses.json" 2>&1)"
  rc=$?
  say "$compared"
  ((rc == 0)) || FAILED+=(python_fp32_losses)
else
  FAILED+=(python_fp32_losses)
  say "- FP32 losses, Python against trainkit: not compared (python_fp32 failed, or gpu_check wrote no $B/gpu_losses.json)"
fi

# --- 4. NCCL: start-up, DataParallel, resume ----------------------------------------------------
say ""
say "### NCCL at world size 1: process-group start-up, DataParallel through a trainer, resume, the sharded collectives"
say ""
if [[ ! -f "$ROOT/include/trainkit/parallel/data_parallel.hpp" ]]; then
  say "- trainkit: SKIPPED, include/trainkit/parallel/data_parallel.hpp is not in this tree"
else
  nccl_args=()
  [[ "$MODE" == "--dry-run" ]] && nccl_args=(--dry-run)
  step nccl_startup 90 "$B/benchmarks/gpu/nccl_startup" ${nccl_args[@]+"${nccl_args[@]}"}
  grep -E "^(- |PASS|FAIL)" "$LOGS/nccl_startup.log" | tee -a "$REPORT"
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

say ""
say "Total $(($(date +%s) - START)) s. Logs: $LOGS"
if ((${#FAILED[@]} > 0)); then
  say "FAIL: ${FAILED[*]}"
  exit 1
fi
say "PASS"
