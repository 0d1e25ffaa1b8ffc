#!/usr/bin/env bash
# Instructions per window of the trainer's step (callgrind; stable where seconds are not), for
# one or more builds of tests/dist/driver.cpp: rank 0 of a 2-rank run on loopback, collected only
# inside Trainer::micro_step_impl (the forward, the backward, the storage's calls and the optimizer
# phase), one intra-op thread. A reorganisation that adds a per-window cost shows here first: the
# model is the driver's tiny MLP, so the step's fixed costs dominate.
#
#   benchmarks/window_instructions.sh [BUILD_DIR...]     (default: build/)
# Environment: WINDOW_STAGES (default "0 2"), WINDOW_ACCUM (default "1 4"), WINDOW_STEPS (default 8),
#              WINDOW_PRECISION (default fp32).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILDS=("$@")
((${#BUILDS[@]})) || BUILDS=("$ROOT/build")
STAGES="${WINDOW_STAGES:-0 2}"
ACCUMS="${WINDOW_ACCUM:-1 4}"
STEPS="${WINDOW_STEPS:-8}"
PRECISION="${WINDOW_PRECISION:-fp32}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
port=29750
echo "| build | stage | micro-batches per window | instructions per window (rank 0) |"
echo "|---|---|---|---|"
for build in "${BUILDS[@]}"; do
  driver="$build/tests/trainkit_dist_driver"
  [[ -x "$driver" ]] || { echo "window_instructions.sh: no $driver" >&2; exit 2; }
  for stage in $STAGES; do
    for accum in $ACCUMS; do
      port=$((port + 1))
      run="$OUT/$(basename "$(dirname "$build")")-s$stage-a$accum"
      pids=()
      for r in 0 1; do
        OMP_NUM_THREADS=1 RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
          valgrind --tool=callgrind --callgrind-out-file="$run.cg$r" --collect-atstart=no \
          '--toggle-collect=*micro_step_impl*' \
          "$driver" --out "$run" --sharding "$stage" --precision "$PRECISION" --accum "$accum" --batch 4 \
          --steps "$STEPS" --samples $((4 * accum * STEPS)) --timeout 900 >"$run.log$r" 2>&1 &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p" || { echo "window_instructions.sh: a rank failed ($run.log*)" >&2; exit 1; }; done
      total="$(callgrind_annotate "$run.cg0" 2>/dev/null | sed -n 's/^ *\([0-9,]*\) .*PROGRAM TOTALS.*/\1/p' | tr -d ,)"
      echo "| $build | $stage | $accum | $((total / STEPS)) |"
    done
  done
done
