#!/usr/bin/env bash
# Prepare the shipped Multi30k de-en data for fairseq: a joint sentencepiece model (6000
# pieces) and fairseq-preprocess with a joined dictionary. Skips the work if already done.
#   bash scripts/prepare_multi30k.sh OUT_DIR
# writes OUT_DIR/bin, OUT_DIR/spm.model and the references OUT_DIR/{valid,test}.ref.en (the text as
# shipped). Expects the environment to be active (fairseq-preprocess on PATH). The studies of
# results/quality.py and results/convert.py and scripts/quickstart.sh train on it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?usage: prepare_multi30k.sh OUT_DIR}
DATA=$ROOT/data/multi30k
mkdir -p "$OUT"
for split in valid test; do
  [ -f "$OUT/$split.ref.en" ] || gunzip -c "$DATA/$split.en.gz" > "$OUT/$split.ref.en"
done
if [ -f "$OUT/bin/dict.en.txt" ]; then
  echo "[prepare] $OUT/bin exists, reusing it"
  exit 0
fi
echo "[prepare] sentencepiece (joint, 6000 pieces) and fairseq-preprocess into $OUT/bin"
python "$ROOT/scripts/sentencepiece_tool.py" train --model-prefix "$OUT/spm" --vocab-size 6000 \
  "$DATA/train.de.gz" "$DATA/train.en.gz"
for split in train valid test; do
  python "$ROOT/scripts/sentencepiece_tool.py" encode --model "$OUT/spm.model" \
    "$DATA/$split.de.gz" "$OUT/$split.spm.de" "$DATA/$split.en.gz" "$OUT/$split.spm.en"
done
fairseq-preprocess --source-lang de --target-lang en --joined-dictionary --workers 2 \
  --trainpref "$OUT/train.spm" --validpref "$OUT/valid.spm" --testpref "$OUT/test.spm" \
  --destdir "$OUT/bin" > "$OUT/preprocess.log" 2>&1
