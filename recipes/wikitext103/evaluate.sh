#!/usr/bin/env bash
# Perplexity of a trained WikiText-103 model on the validation and test sets:
#
#   bash recipes/wikitext103/evaluate.sh VARIANT [extra fairseq-eval-lm flags]
#   SIZE=small bash recipes/wikitext103/evaluate.sh VARIANT    # the small model's run
#
# fairseq-eval-lm on checkpoint_best.pt (CHECKPOINT=path to choose another), twice per split:
# - 512-token blocks scored independently (--context-window 0: no context is carried over from
#   one block to the next, so early tokens of a block see little context). This is the RFA
#   paper's evaluation ("context window 512, not stateful") and the number to compare with it.
# - a sliding window: blocks of 512 tokens whose first CONTEXT_WINDOW (default 400, as fairseq's
#   language-model example) are context only, so every scored token sees at least 400 tokens.
#   Lower perplexity, comparable with fairseq's and Baevski and Auli's way of scoring.
# Outputs in $WORK/eval/RUN/ (RUN: the run name given to train.sh, default VARIANT, VARIANT.small
# with SIZE=small).
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wikitext103
select_size big small
if [ "$SIZE" = small ]; then
  set_variant "${1:-}" transformer_lm_wiki103 rfa_transformer_lm_wiki103_small
else
  set_variant "${1:-}" transformer_lm_wiki103 rfa_transformer_lm_wiki103
fi
shift
if [ "$SMOKE" = 1 ]; then
  TOKENS_PER_SAMPLE=64 CONTEXT_WINDOW=${CONTEXT_WINDOW:-32} EVAL_ARGS=(--cpu)
else
  TOKENS_PER_SAMPLE=512 CONTEXT_WINDOW=${CONTEXT_WINDOW:-400} EVAL_ARGS=()
fi
[[ $CONTEXT_WINDOW =~ ^[0-9]+$ ]] && [ "$CONTEXT_WINDOW" -gt 0 ] && [ "$CONTEXT_WINDOW" -lt "$TOKENS_PER_SAMPLE" ] ||
  die "CONTEXT_WINDOW must be between 1 and $((TOKENS_PER_SAMPLE - 1)) (the blocks have $TOKENS_PER_SAMPLE tokens), got '$CONTEXT_WINDOW'"
CHECKPOINT=${CHECKPOINT:-$CKPT_DIR/checkpoint_best.pt}
[ -f "$CHECKPOINT" ] || die "no $CHECKPOINT: run train.sh $VARIANT first (with the same RUN / SIZE)"
EVAL_DIR=$WORK/eval/$RUN
mkdir -p "$EVAL_DIR"
# Results are tied to the checkpoint file's version (its time stamp): evaluating again after
# more training (a new checkpoint_best.pt) redoes them.
TAG=$(basename "$CHECKPOINT" .pt).$(date -r "$CHECKPOINT" +%Y%m%d-%H%M%S)

eval_lm() {
  local split=$1 window=$2; shift 2
  # --required-batch-size-multiple 1: fairseq would otherwise drop a last partial batch of blocks.
  fairseq-eval-lm "$DATA_BIN" --user-dir "$USER_DIR" --path "$CHECKPOINT" --gen-subset "$split" \
    --tokens-per-sample "$TOKENS_PER_SAMPLE" --context-window "$window" \
    --max-tokens "${EVAL_MAX_TOKENS:-3072}" --softmax-batch 1024 --required-batch-size-multiple 1 \
    ${EVAL_ARGS[@]+"${EVAL_ARGS[@]}"} "$@" 2>&1 | tee "$EVAL_DIR/eval_lm.$split.$TAG.cw$window.log"
}

for split in valid test; do
  for window in 0 "$CONTEXT_WINDOW"; do
    step "eval-lm.$RUN.$split.$TAG.cw$window" eval_lm "$split" "$window" "$@"
  done
done
log "results ($EVAL_DIR/eval_lm.*.$TAG.cw*.log):"
for split in valid test; do
  for window in 0 "$CONTEXT_WINDOW"; do
    f=$EVAL_DIR/eval_lm.$split.$TAG.cw$window.log
    ppl=$(grep -o 'Perplexity: [0-9.]*' "$f" | tail -n 1 | cut -d' ' -f2)
    [ -n "$ppl" ] || die "no perplexity in $f"
    if [ "$window" = 0 ]; then
      how="$TOKENS_PER_SAMPLE-token blocks, --context-window 0 (the RFA paper's setting)"
    else
      how="sliding window, --context-window $window in $TOKENS_PER_SAMPLE-token blocks"
    fi
    echo "$split perplexity, $how: $ppl ($(grep -o 'Evaluated [0-9,]* tokens' "$f" | tail -n 1), $(basename "$CHECKPOINT"))"
  done
done
