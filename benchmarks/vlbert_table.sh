#!/usr/bin/env bash
# The guide's comparison table for VL-BERT VQA fine-tuning: FP32 / FP16 / FP32 + 4-step
# accumulation / FP16 + 4-step accumulation at the same effective batch, plus BF16 rows.
# One pre-training run (FP32, the default config) gives the weights; each row is then a separate
# `vlbert vqa` process (so its peak RSS, VmHWM, is its own) on the default VQA config with:
#   FP16 rows   TRAIN.FP16=true TRAIN.FP16_LOSS_SCALE=dynamic
#   BF16 rows   TRAIN.BF16=true
#   4-step rows TRAIN.GRAD_ACCUMULATE_STEPS=4 and TRAIN.BATCH_IMAGES = batch / 4
#   +rc rows    (a suffix, e.g. fp32x4+rc) NETWORK.RECOMPUTE=true: each encoder layer's
#               activations recomputed in backward (tk::recompute)
#   +plan rows  (a suffix, e.g. fp32+plan, fp32+rc+plan) TRAIN.MEMORY_BUDGET=$VLBERT_TABLE_BUDGET:
#               fit measures the micro-batch's forward+backward and runs it as pieces that fit
#               (the table shows the piece size and what measuring cost)
#   dp2 rows    2 data-parallel processes (torchrun --standalone, Gloo on the CPU) with
#               TRAIN.BATCH_IMAGES = batch / 2 each: time per sample over both ranks' samples,
#               peak RSS the larger rank's
#   +z3 rows    (a suffix of dp2 rows, e.g. fp32dp2+z3, fp32dp2+z3+plan) TRAIN.ZERO_STAGE=3
# Prints a Markdown table (and the machine) on stdout; the rows' RESULT lines go to $DIR/rows.jsonl.
#
#   benchmarks/vlbert_table.sh [--set K=V]...     (the --set values go to every run)
# Environment:
#   TRAINKIT_BUILD_DIR   build directory (default build/); the program is built if missing
#   VLBERT_TABLE_DIR     working directory (default output/vlbert/table; emptied first)
#   VLBERT_TABLE_BATCH   effective batch (default 16, the VQA config's)
#   VLBERT_TABLE_ROWS    rows to run (default "fp32 fp16 fp32x4 fp16x4 bf16 bf16x4 fp32dp2")
#   VLBERT_TABLE_BUDGET  TRAIN.MEMORY_BUDGET of +plan rows (default 700MiB)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${TRAINKIT_BUILD_DIR:-$ROOT/build}"
DIR="${VLBERT_TABLE_DIR:-$ROOT/output/vlbert/table}"
BATCH="${VLBERT_TABLE_BATCH:-16}"
ROWS="${VLBERT_TABLE_ROWS:-fp32 fp16 fp32x4 fp16x4 bf16 bf16x4 fp32dp2}"
BUDGET="${VLBERT_TABLE_BUDGET:-700MiB}"
PROGRAM="$BUILD_DIR/examples/vlbert/vlbert"
[[ -x "$PROGRAM" ]] || "$ROOT/scripts/build" --target example_vlbert
if (( BATCH % 4 != 0 )); then echo "VLBERT_TABLE_BATCH must be a multiple of 4, got $BATCH" >&2; exit 2; fi

rm -rf "$DIR"
mkdir -p "$DIR"
echo "[table] pre-training (FP32) for the rows' initial weights" >&2
"$PROGRAM" pretrain --cfg "$ROOT/cfgs/vlbert/pretrain/base_1x24G_fp32.yaml" --model-dir "$DIR/pretrain" "$@" >"$DIR/pretrain.out"
checkpoint="$(sed -n 's/^RESULT .*"checkpoint":"\([^"]*\)".*/\1/p' "$DIR/pretrain.out")"

for row in $ROWS; do
  sets=(--set "TRAIN.BATCH_IMAGES=$BATCH" --set TRAIN.GRAD_ACCUMULATE_STEPS=1)
  case "$row" in
    fp16*) sets+=(--set TRAIN.FP16=true --set TRAIN.FP16_LOSS_SCALE=dynamic) ;;
    bf16*) sets+=(--set TRAIN.BF16=true) ;;
    fp32*) ;;
    *) echo "unknown row '$row' (fp32, fp16, bf16, each optionally with x4)" >&2; exit 2 ;;
  esac
  base="${row%%+*}"
  [[ "$row" == *+rc* ]] && sets+=(--set NETWORK.RECOMPUTE=true)
  [[ "$row" == *+plan* ]] && sets+=(--set "TRAIN.MEMORY_BUDGET=$BUDGET")
  [[ "$row" == *+z3* ]] && sets+=(--set TRAIN.ZERO_STAGE=3)
  if [[ "$base" == *x4 ]]; then sets+=(--set "TRAIN.BATCH_IMAGES=$((BATCH / 4))" --set TRAIN.GRAD_ACCUMULATE_STEPS=4); fi
  launch=("$PROGRAM")
  if [[ "$base" == *dp2 ]]; then
    sets+=(--set "TRAIN.BATCH_IMAGES=$((BATCH / 2))")
    launch=("$ROOT/.venv/bin/torchrun" --standalone --nproc-per-node 2 --no-python "$PROGRAM")
  fi
  echo "[table] $row: ${launch[*]} vqa ${sets[*]} $*" >&2
  "${launch[@]}" vqa --cfg "$ROOT/cfgs/vlbert/vqa/base_1x24G_fp32.yaml" --model-dir "$DIR/$row" \
    --set "NETWORK.PARTIAL_PRETRAIN=$checkpoint" "${sets[@]}" "$@" >"$DIR/$row.out"
  sed -n "s/^RESULT \(.*\)$/{\"row\": \"$row\", \"result\": \1}/p" "$DIR/$row.out" >>"$DIR/rows.jsonl"
done

python3 - "$DIR/rows.jsonl" "$BATCH" <<'PY'
import json, os, platform, subprocess, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
batch = int(sys.argv[2])
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
print(f"Machine: {cpu}, {os.cpu_count()} cores; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
print()
print("| precision | processes | accumulation | micro-batch | effective batch | trainer | peak RSS per process (MiB) | time per sample (ms) | skipped steps | final VQA accuracy |")
print("|---|---|---|---|---|---|---|---|---|---|")
notes = []
base = None
for r in rows:
    res, name = r["result"], r["row"]
    acc = 4 if name.split("+")[0].endswith("x4") else 1
    procs = res.get("world_size", 1)
    prec = (name[:4].upper() + (" + ZeRO-3" if "+z3" in name else "") + (" + recompute" if "+rc" in name else "")
            + (" + planned" if "+plan" in name else ""))
    micro = str(batch // acc // procs)
    if res.get("piece_items", 0) > 0:
        micro += f" (pieces of {res['piece_items']})"
    if res.get("plan_seconds", 0) > 0:
        notes.append(f"{name}: planning took {res['plan_seconds']:.2f} s (included in the time per sample)")
    if res.get("replays", 0) > 0:
        notes.append(f"{name}: {res['replays']} window(s) replayed after running out of memory")
    ms = res["ms_per_sample"]
    base = base or ms
    print(f"| {prec} | {procs} | {acc} | {micro} | {batch} | `{res['trainer']}` | {res['peak_rss_mib']:.0f} | "
          f"{ms:.3f} ({ms / base:.2f}x) | {res['skipped_steps']} | {res['val'].get('Acc', float('nan')):.4f} |")
for n in notes:
    print(f"- {n}")
PY
