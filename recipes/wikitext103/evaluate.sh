#!/usr/bin/env bash
# Perplexity of a trained WikiText-103 model on the validation and test sets:
#
#   bash recipes/wikitext103/evaluate.sh VARIANT [extra fairseq-eval-lm flags]
#
# fairseq-eval-lm on checkpoint_best.pt (CHECKPOINT=path to choose another) with blocks of 512
# tokens of which the first CONTEXT_WINDOW (default 400, as fairseq's language-model example)
# are context only: every scored token sees at least 400 tokens of context (0 scores disjoint
# 512-token blocks; perplexity is then higher). Outputs in $WORK/eval/VARIANT/.
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wikitext103
set_variant "${1:-}" transformer_lm_wiki103 rfa_transformer_lm_wiki103 --rfa-causal-feature-dim 64
shift
if [ "$SMOKE" = 1 ]; then
  TOKENS_PER_SAMPLE=64 CONTEXT_WINDOW=${CONTEXT_WINDOW:-32} EVAL_ARGS=(--cpu)
else
  TOKENS_PER_SAMPLE=512 CONTEXT_WINDOW=${CONTEXT_WINDOW:-400} EVAL_ARGS=()
fi
CHECKPOINT=${CHECKPOINT:-$CKPT_DIR/checkpoint_best.pt}
[ -f "$CHECKPOINT" ] || die "no $CHECKPOINT: run train.sh $VARIANT first"
EVAL_DIR=$WORK/eval/$VARIANT
mkdir -p "$EVAL_DIR"
# Results are tied to the checkpoint file's version (its time stamp): evaluating again after
# more training (a new checkpoint_best.pt) redoes them.
TAG=$(basename "$CHECKPOINT" .pt).$(date -r "$CHECKPOINT" +%Y%m%d-%H%M%S).cw$CONTEXT_WINDOW

eval_lm() {
  local split=$1; shift
  # --required-batch-size-multiple 1: fairseq would otherwise drop a last partial batch of blocks.
  fairseq-eval-lm "$DATA_BIN" --user-dir "$USER_DIR" --path "$CHECKPOINT" --gen-subset "$split" \
    --tokens-per-sample "$TOKENS_PER_SAMPLE" --context-window "$CONTEXT_WINDOW" \
    --max-tokens "${EVAL_MAX_TOKENS:-3072}" --softmax-batch 1024 --required-batch-size-multiple 1 \
    "${EVAL_ARGS[@]}" "$@" 2>&1 | tee "$EVAL_DIR/eval_lm.$split.$TAG.log"
}

for split in valid test; do
  step "eval-lm.$VARIANT.$split.$TAG" eval_lm "$split" "$@"
done
log "results ($EVAL_DIR/eval_lm.*.$TAG.log):"
for split in valid test; do
  f=$EVAL_DIR/eval_lm.$split.$TAG.log
  ppl=$(grep -o 'Perplexity: [0-9.]*' "$f" | tail -n 1 | cut -d' ' -f2)
  [ -n "$ppl" ] || die "no perplexity in $f"
  echo "$split perplexity: $ppl ($(grep -o 'Evaluated [0-9,]* tokens' "$f" | tail -n 1), $(basename "$CHECKPOINT"), context window $CONTEXT_WINDOW)"
done
