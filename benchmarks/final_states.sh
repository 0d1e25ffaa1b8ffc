#!/usr/bin/env bash
# The distributed driver's final states, hashed: a reorganisation that changes no behaviour
# prints the same table before and after. Each row is one run of tests/dist/driver.cpp
# (trainkit_dist_driver) on loopback ranks, 6 windows of 2 micro-batches with item-weighted
# windows, then a checkpoint (one file: rank 0's, gathered) and a checkpoint set (a file per
# rank); a row hashes every rank's flat parameters (.bin), the checkpoint and the set's files.
#
#   benchmarks/final_states.sh [--ranks "2 3"] [--stages "0 1 2 3"] [--precisions "fp32 fp16master bf16master"]
#
# Prints a markdown table, one row per (ranks, stage, precision): the sha256 of each kind of
# output (first 16 hex digits). Environment: TRAINKIT_BUILD_DIR (default build/),
# FINAL_STATES_DIR (default output/final_states, emptied first).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${TRAINKIT_BUILD_DIR:-$ROOT/build}"
DIR="${FINAL_STATES_DIR:-$ROOT/output/final_states}"
RANKS="2 3"
STAGES="0 1 2 3"
PRECISIONS="fp32 fp16master bf16master"
while (($#)); do
  case "$1" in
    --ranks) RANKS="$2"; shift 2 ;;
    --stages) STAGES="$2"; shift 2 ;;
    --precisions) PRECISIONS="$2"; shift 2 ;;
    *) echo "final_states.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
DRIVER="$BUILD_DIR/tests/trainkit_dist_driver"
[[ -x "$DRIVER" ]] || "$ROOT/scripts/build" --target trainkit_dist_driver
rm -rf "$DIR"
mkdir -p "$DIR"

short() { sha256sum "$@" | cut -c1-16; }
# The hash of a set's tensor files, in name order, each set's token zeroed.
hash_set() {
  (cd "$1" && for f in $(find . -type f -name '*.safetensors' | sort); do
     echo "$f"; sed -E 's/"trainkit\.token":"[0-9a-f]+"/"trainkit.token":"0"/' "$f"
   done) | sha256sum | cut -c1-16
}

port=29650
echo "| ranks | stage | precision | parameters (.bin, every rank) | checkpoint | checkpoint set (.safetensors) |"
echo "|---|---|---|---|---|---|"
for world in $RANKS; do
  for stage in $STAGES; do
    for precision in $PRECISIONS; do
      run="$DIR/w$world-s$stage-$precision"
      mkdir -p "$run"
      port=$((port + 1))
      pids=()
      for ((r = 0; r < world; ++r)); do
        RANK=$r WORLD_SIZE=$world LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
          "$DRIVER" --out "$run/out" --sharding "$stage" --precision "$precision" --accum 2 --batch 4 \
          --steps 6 --items 1 --samples 96 --save "$run/ckpt.pt" --save-set "$run/set" \
          >"$run/log$r" 2>&1 &
        pids+=($!)
      done
      for p in "${pids[@]}"; do
        wait "$p" || { echo "final_states.sh: a rank of $run failed (see $run/log*)" >&2; exit 1; }
      done
      params="$(cat "$run"/out.rank*.bin | sha256sum | cut -c1-16)"
      echo "| $world | $stage | $precision | $params | $(short "$run/ckpt.pt") | $(hash_set "$run/set") |"
    done
  done
done
