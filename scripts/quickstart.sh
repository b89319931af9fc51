#!/usr/bin/env bash
# Quickstart: train a small RFA-Gate German->English model on Multi30k (shipped in
# data/multi30k) for a fixed number of updates with a fixed seed, decode the test set with
# beam 4, print sacreBLEU and speed. The same BLEU on every machine; only the time differs.
#
#   bash scripts/quickstart.sh                    # 330 updates
#   RFA_QUICKSTART_UPDATES=1000 bash scripts/quickstart.sh
#
# Work files go to work/quickstart/ (RFA_WORK to change). Re-running reuses the prepared data.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
bash scripts/setup_env.sh
if [ "${RFA_USE_CURRENT_ENV:-0}" != "1" ]; then . "${RFA_VENV:-$ROOT/.venv}/bin/activate"; fi
UPDATES=${RFA_QUICKSTART_UPDATES:-330}
WORK=${RFA_WORK:-$ROOT/work/quickstart}
mkdir -p "$WORK"
export PYTHONWARNINGS=ignore

echo "== 1/4 sentencepiece (joint, 6000 pieces) and fairseq-preprocess"
bash scripts/prepare_multi30k.sh "$WORK"

echo "== 2/4 fairseq-train: rfa_transformer_iwslt_de_en --rfa-gate, small (2+2 layers, 256 dims), ${UPDATES} updates"
rm -rf "$WORK/checkpoints"
if ! fairseq-train "$WORK/bin" --user-dir rfa_fairseq \
  --arch rfa_transformer_iwslt_de_en --rfa-gate --share-all-embeddings \
  --encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 256 --decoder-embed-dim 256 \
  --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512 \
  --encoder-attention-heads 4 --decoder-attention-heads 4 --dropout 0.1 \
  --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 \
  --lr 3e-3 --lr-scheduler inverse_sqrt --warmup-updates 150 \
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
  --max-tokens 4000 --seed 1 --max-update "$UPDATES" \
  --save-dir "$WORK/checkpoints" --no-epoch-checkpoints --log-format simple --log-interval 25 \
  --cpu 2>&1 | python scripts/train_progress.py "$UPDATES" "$WORK/train.log"; then
  echo "fairseq-train failed; see $WORK/train.log"; exit 1
fi

echo "== 3/4 fairseq-generate --beam 4 on the 1,000 test sentences"
fairseq-generate "$WORK/bin" --user-dir rfa_fairseq --path "$WORK/checkpoints/checkpoint_last.pt" \
  --gen-subset test --beam 4 --batch-size 64 --max-len-a 1.2 --max-len-b 10 \
  --post-process sentencepiece --cpu \
  > "$WORK/generate.out" 2> "$WORK/generate.log"

echo "== 4/4 results (sacreBLEU against the tokenised lower-cased references)"
python scripts/score_translation.py "$WORK/generate.out" "$WORK/generate.log" "$WORK/test.ref.en"
echo "outputs: $WORK (train.log, generate.out)"
