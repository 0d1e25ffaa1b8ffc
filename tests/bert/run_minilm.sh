#!/usr/bin/env bash
# The BERT configurations end to end, briefly: cfgs/vlbert/pretrain/minilm_1x24G_fp32.yaml for one
# small epoch from all-MiniLM-L6-v2 (scripts/get-bert), then cfgs/vlbert/vqa/minilm_1x24G_fp32.yaml
# from that checkpoint. Checks that BERT's 101 language weights were loaded and that VQA took every
# backbone weight from the pre-training checkpoint. Run by ctest (vlbert.minilm_brief):
#   tests/bert/run_minilm.sh VLBERT_BINARY WORK_DIR
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="$1"
WORK="$2"
rm -rf "$WORK"
mkdir -p "$WORK"
"$ROOT/scripts/get-bert" >/dev/null
cd "$ROOT"  # the configurations name ./model/pretrained_model/... from the repository's root
small=(--set TRAIN.END_EPOCH=1 --set DATASET.TRAIN_SCENES=48 --set DATASET.VAL_SCENES=16)
"$BIN" pretrain --cfg cfgs/vlbert/pretrain/minilm_1x24G_fp32.yaml --model-dir "$WORK/pretrain" "${small[@]}" \
  > "$WORK/pretrain.out" 2> "$WORK/pretrain.err" || { cat "$WORK/pretrain.err"; echo "FAIL: pretrain"; exit 1; }
grep -q '^RESULT {"bert":{"loaded":101,' "$WORK/pretrain.out" || { cat "$WORK/pretrain.out"; echo "FAIL: pretrain did not load BERT's 101 weights"; exit 1; }
grep -q "token types loaded into rows 0-1" "$WORK/pretrain.err" || { cat "$WORK/pretrain.err"; echo "FAIL: no token-type note"; exit 1; }
checkpoint="$(sed -n 's/^RESULT .*"checkpoint":"\([^"]*\)".*/\1/p' "$WORK/pretrain.out")"
"$BIN" vqa --cfg cfgs/vlbert/vqa/minilm_1x24G_fp32.yaml --model-dir "$WORK/vqa" "${small[@]}" \
  --set "NETWORK.PARTIAL_PRETRAIN=$checkpoint" > "$WORK/vqa.out" 2> "$WORK/vqa.err" || { cat "$WORK/vqa.err"; echo "FAIL: vqa"; exit 1; }
# The VQA model's backbone (111 weights: BERT's 101 and the visual 10) from the checkpoint; the classifier new.
grep -q '"partial_pretrain":{"loaded":111,"not_loaded":\["final_mlp.1.weight","final_mlp.1.bias","final_mlp.4.weight","final_mlp.4.bias"\]' "$WORK/vqa.out" \
  || { cat "$WORK/vqa.out"; echo "FAIL: VQA did not take the backbone from the checkpoint"; exit 1; }
grep "^VQA validation accuracy" "$WORK/vqa.out"
echo "PASS: pre-training from all-MiniLM-L6-v2, then VQA from its checkpoint"
