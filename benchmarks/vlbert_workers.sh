#!/usr/bin/env bash
# Batches made ahead (NUM_WORKERS_PER_GPU) against made on the training thread, on the VL-BERT
# example's pre-training: each row a `vlbert pretrain` process on the default config for
# END_EPOCH epochs, the rows interleaved REPS times; prints each row's median ms per sample
# (training time only, from the RESULT line) and its ratio to workers 0, with the load average.
#
#   benchmarks/vlbert_workers.sh [--set K=V]...     (the --set values go to every run)
# Environment: TRAINKIT_BUILD_DIR (default build/), VLBERT_WORKERS (default "0 1 2"),
#              VLBERT_WORKERS_REPS (default 3), VLBERT_WORKERS_DIR (default output/vlbert/workers).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${TRAINKIT_BUILD_DIR:-$ROOT/build}"
DIR="${VLBERT_WORKERS_DIR:-$ROOT/output/vlbert/workers}"
WORKERS="${VLBERT_WORKERS:-0 1 2}"
REPS="${VLBERT_WORKERS_REPS:-3}"
PROGRAM="$BUILD_DIR/examples/vlbert/vlbert"
[[ -x "$PROGRAM" ]] || "$ROOT/scripts/build" --target example_vlbert
rm -rf "$DIR"
mkdir -p "$DIR"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((rep = 0; rep < REPS; ++rep)); do
  for w in $WORKERS; do
    "$PROGRAM" pretrain --cfg "$ROOT/cfgs/vlbert/pretrain/base_1x24G_fp32.yaml" --model-dir "$DIR/w$w-r$rep" \
      --set "NUM_WORKERS_PER_GPU=$w" "$@" 2>"$DIR/w$w-r$rep.err" | sed -n "s/^RESULT //p" >>"$DIR/w$w.jsonl"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$DIR" $WORKERS <<'PY'
import json, statistics, sys
d, workers = sys.argv[1], sys.argv[2:]
med = {}
for w in workers:
    rows = [json.loads(l) for l in open(f"{d}/w{w}.jsonl")]
    med[w] = statistics.median(r["ms_per_sample"] for r in rows)
    losses = {tuple(r["epoch_loss"]) for r in rows}
print("| NUM_WORKERS_PER_GPU | ms per sample (median) | vs 0 |")
print("|---|---|---|")
for w in workers:
    print(f"| {w} | {med[w]:.3f} | {med[w] / med[workers[0]]:.3f}x |")
PY
# The same losses whatever made the batches.
for w in $WORKERS; do sed -n 's/.*"epoch_loss":\(\[[^]]*\]\).*/\1/p' "$DIR/w$w.jsonl" | sort -u; done | sort -u | wc -l | \
  awk '{ print ($1 == 1 ? "epoch losses: identical in every run" : "epoch losses differ between runs: " $1 " distinct") }'
