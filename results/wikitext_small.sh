#!/usr/bin/env bash
# Language modelling on real WikiText-103 text (the valid+test files, split by article into
# train/valid/test; see split_wikitext_by_article.py): softmax vs RFA vs RFA-Gate with the same
# small model (4 layers, 256 dims, 4 heads, FFN 1024, context 256, adaptive softmax) and the
# same budget (a fixed number of updates); test perplexity from fairseq-eval-lm.
#   bash results/wikitext_small.sh        # UPDATES=200 SEED=1; needs ../shared/data/wikitext103-eval
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
bash scripts/setup_env.sh >/dev/null
. "${RFA_VENV:-$ROOT/.venv}/bin/activate"
export PYTHONWARNINGS=ignore
UPDATES=${UPDATES:-200}
SEED=${SEED:-1}
SRC=${WIKITEXT_EVAL_DIR:-$ROOT/../shared/data/wikitext103-eval}
WORK=${RFA_WORK:-$ROOT/work/results/wikitext}
OUT=${OUT:-$ROOT/results/wikitext_small.jsonl}
if [ ! -f "$WORK/bin/dict.txt" ]; then
  python results/split_wikitext_by_article.py "$WORK/text" "$SRC/wiki.valid.tokens" "$SRC/wiki.test.tokens"
  fairseq-preprocess --only-source --trainpref "$WORK/text/train.tokens" --validpref "$WORK/text/valid.tokens" \
    --testpref "$WORK/text/test.tokens" --destdir "$WORK/bin" --workers 2 > "$WORK/preprocess.log" 2>&1
fi
: > "$OUT"

for variant in ${VARIANTS:-softmax rfa rfa_gate}; do
  case $variant in
    softmax)  arch=(--arch transformer_lm) ;;
    rfa)      arch=(--user-dir rfa_fairseq --arch rfa_transformer_lm) ;;
    rfa_gate) arch=(--user-dir rfa_fairseq --arch rfa_transformer_lm --rfa-gate) ;;
  esac
  ckpt=$WORK/$variant
  rm -rf "$ckpt"; mkdir -p "$ckpt"
  echo "== $variant: training $UPDATES updates"
  start=$(date +%s)
  fairseq-train "$WORK/bin" --task language_modeling "${arch[@]}" \
    --decoder-layers 4 --decoder-embed-dim 256 --decoder-ffn-embed-dim 1024 --decoder-attention-heads 4 \
    --dropout 0.2 --tokens-per-sample 256 --sample-break-mode none \
    --adaptive-softmax-cutoff 3000,10000 --criterion adaptive_loss --ddp-backend legacy_ddp \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 \
    --lr 2e-3 --lr-scheduler inverse_sqrt --warmup-updates 100 \
    --max-tokens 4096 --seed "$SEED" --max-update "$UPDATES" \
    --save-dir "$ckpt" --no-epoch-checkpoints --log-format simple --log-interval 50 --cpu \
    > "$ckpt/train.log" 2>&1
  train_s=$(( $(date +%s) - start ))
  echo "   trained in ${train_s}s; evaluating"
  fairseq-eval-lm "$WORK/bin" --user-dir rfa_fairseq --path "$ckpt/checkpoint_last.pt" --gen-subset test \
    --tokens-per-sample 256 --context-window 128 --max-tokens 4096 --cpu > "$ckpt/eval.log" 2>&1
  python - "$ckpt/eval.log" "$OUT" "$variant" "$UPDATES" "$SEED" "$train_s" <<'PY'
import json, re, sys
log, out, variant, updates, seed, train_s = sys.argv[1:]
m = re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", open(log).read())
if not m:
    sys.exit(f"no perplexity in {log}")
rec = {"label": variant, "updates": int(updates), "seed": int(seed), "train_s": int(train_s),
       "test_loss_base2": float(m.group(1)), "test_ppl": float(m.group(2))}
print(f"   test perplexity {rec['test_ppl']:.2f}")
open(out, "a").write(json.dumps(rec) + "\n")
PY
done
echo "wrote $OUT"
