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

echo "== 1/3 sentencepiece (joint, 6000 pieces) and fairseq-preprocess"
bash scripts/prepare_multi30k.sh "$WORK/data"

# the training command is results/quality.py's (its quickstart setting: 2+2 layers, 256 dims)
echo "== 2/3 fairseq-train (rfa_transformer_iwslt_de_en --rfa-gate, ${UPDATES} updates) and fairseq-generate --beam 4 on the 1,000 test sentences"
rm -rf "$WORK/quickstart" "$WORK/quickstart.jsonl"
if ! python results/quality.py --setting quickstart --variants gate_softcross --seeds 1 --updates "$UPDATES" \
  --work "$WORK" --out "$WORK/quickstart.jsonl" --cpu --progress; then
  echo "the quickstart failed; see the logs under $WORK/quickstart"; exit 1
fi
RUN=$(echo "$WORK"/quickstart/gate_softcross-seed1*)

echo "== 3/3 results (sacreBLEU against the tokenised lower-cased references)"
python scripts/score_translation.py "$RUN/generate.test.out" "$RUN/generate.test.log" "$WORK/data/test.ref.en"
echo "outputs: $RUN (train.log, generate.test.out)"
