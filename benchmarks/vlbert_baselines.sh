#!/usr/bin/env bash
# Do the synthetic VQA questions need both modalities? Fine-tunes the default VQA config three
# times from one pre-trained checkpoint: the joint model, a text-only model (DATASET.BLANK=image:
# no regions at all) and a vision-only model (DATASET.BLANK=question: the text is [CLS] [MASK]
# [SEP]), and prints their validation accuracy next to chance and the best answer per question
# type (the strongest text-only rule on this generator).
#
#   benchmarks/vlbert_baselines.sh [CHECKPOINT] [--set K=V]...
# Without CHECKPOINT the default pre-training config is run first. Environment:
#   TRAINKIT_BUILD_DIR   build directory (default build/)
#   VLBERT_BASELINES_DIR working directory (default output/vlbert/baselines; emptied first)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${TRAINKIT_BUILD_DIR:-$ROOT/build}"
DIR="${VLBERT_BASELINES_DIR:-$ROOT/output/vlbert/baselines}"
PROGRAM="$BUILD_DIR/examples/vlbert/vlbert"
[[ -x "$PROGRAM" ]] || "$ROOT/scripts/build" --target example_vlbert
checkpoint=""
if [[ $# -gt 0 && "$1" != --* ]]; then checkpoint="$1"; shift; fi

rm -rf "$DIR"
mkdir -p "$DIR"
if [[ -z "$checkpoint" ]]; then
  "$PROGRAM" pretrain --cfg "$ROOT/cfgs/vlbert/pretrain/base_1x24G_fp32.yaml" --model-dir "$DIR/pretrain" "$@" >"$DIR/pretrain.out"
  checkpoint="$(sed -n 's/^RESULT .*"checkpoint":"\([^"]*\)".*/\1/p' "$DIR/pretrain.out")"
fi
for blank in none image question; do
  echo "[baselines] vlbert vqa --set DATASET.BLANK=$blank (from $checkpoint)" >&2
  "$PROGRAM" vqa --cfg "$ROOT/cfgs/vlbert/vqa/base_1x24G_fp32.yaml" --model-dir "$DIR/$blank" \
    --set "NETWORK.PARTIAL_PRETRAIN=$checkpoint" --set "DATASET.BLANK=$blank" "$@" >"$DIR/$blank.out" &
done
wait
python3 - "$DIR" <<'PY'
import json, sys
rows = {}
for blank in ("none", "image", "question"):
    line = next(l for l in open(f"{sys.argv[1]}/{blank}.out") if l.startswith("RESULT "))
    rows[blank] = json.loads(line[7:])
r = rows["none"]
print("| model | VQA validation accuracy |")
print("|---|---|")
print(f"| joint (question + image) | {r['val']['Acc']:.4f} |")
print(f"| text-only (image blanked) | {rows['image']['val']['Acc']:.4f} |")
print(f"| vision-only (question blanked) | {rows['question']['val']['Acc']:.4f} |")
print(f"| best answer per question type (rule) | {r['question_prior']:.4f} |")
print(f"| majority answer | {r['majority_answer']:.4f} |")
print(f"| chance (1 of {round(1 / r['chance'])} answers) | {r['chance']:.4f} |")
types = sorted(k for k in r["val"] if k.startswith("Acc-"))
print()
print("| question type | " + " | ".join(t[4:] for t in types) + " |")
print("|---|" + "---|" * len(types))
for name, key in (("joint", "none"), ("text-only", "image"), ("vision-only", "question")):
    print(f"| {name} | " + " | ".join(f"{rows[key]['val'][t]:.3f}" for t in types) + " |")
PY
