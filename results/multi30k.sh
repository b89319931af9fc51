#!/usr/bin/env bash
# Multi30k de-en (the small stand-in for IWSLT14): softmax vs RFA vs RFA-Gate, the same small
# model (2+2 layers, 256 dims, 4 heads, FFN 512, joint sentencepiece 6000) and the same budget
# (a fixed number of updates), then beam-4 decoding of the 1,000 test sentences.
#   bash results/multi30k.sh               # UPDATES=600 SEED=1 by default; writes results/multi30k.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
bash scripts/setup_env.sh >/dev/null
. "${RFA_VENV:-$ROOT/.venv}/bin/activate"
export PYTHONWARNINGS=ignore
UPDATES=${UPDATES:-600}
SEED=${SEED:-1}
WORK=${RFA_WORK:-$ROOT/work/results/multi30k}
OUT=${OUT:-$ROOT/results/multi30k.jsonl}
bash scripts/prepare_multi30k.sh "$WORK/data"
: > "$OUT"

for variant in ${VARIANTS:-softmax rfa rfa_gate}; do
  case $variant in
    softmax)  arch=(--arch transformer_iwslt_de_en) ;;
    rfa)      arch=(--user-dir rfa_fairseq --arch rfa_transformer_iwslt_de_en) ;;
    rfa_gate) arch=(--user-dir rfa_fairseq --arch rfa_transformer_iwslt_de_en --rfa-gate) ;;
  esac
  ckpt=$WORK/$variant
  rm -rf "$ckpt"; mkdir -p "$ckpt"
  echo "== $variant: training $UPDATES updates"
  start=$(date +%s)
  fairseq-train "$WORK/data/bin" "${arch[@]}" --share-all-embeddings \
    --encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 256 --decoder-embed-dim 256 \
    --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512 \
    --encoder-attention-heads 4 --decoder-attention-heads 4 --dropout 0.1 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 \
    --lr 3e-3 --lr-scheduler inverse_sqrt --warmup-updates 150 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --max-tokens 4000 --seed "$SEED" --max-update "$UPDATES" \
    --save-dir "$ckpt" --no-epoch-checkpoints --log-format simple --log-interval 100 --cpu \
    > "$ckpt/train.log" 2>&1
  train_s=$(( $(date +%s) - start ))
  echo "   trained in ${train_s}s; decoding"
  fairseq-generate "$WORK/data/bin" --user-dir rfa_fairseq --path "$ckpt/checkpoint_last.pt" \
    --gen-subset test --beam 4 --batch-size 64 --max-len-a 1.2 --max-len-b 10 \
    --post-process sentencepiece --cpu > "$ckpt/generate.out" 2> "$ckpt/generate.log"
  python scripts/score_translation.py "$ckpt/generate.out" "$ckpt/generate.log" "$WORK/data/test.ref.en" \
    --json "$OUT" --label "$variant updates=$UPDATES seed=$SEED train_s=$train_s"
done
echo "wrote $OUT"
