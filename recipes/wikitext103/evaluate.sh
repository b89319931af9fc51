#!/usr/bin/env bash
# Perplexity of a trained WikiText-103 model on the validation and test sets:
#
#   bash recipes/wikitext103/evaluate.sh VARIANT [extra fairseq-eval-lm flags]
#   SIZE=small bash recipes/wikitext103/evaluate.sh VARIANT    # the small model's run
#   STATEFUL=1 bash recipes/wikitext103/evaluate.sh rfa_gate   # the run train.sh made with STATEFUL=1
#
# fairseq-eval-lm on checkpoint_best.pt (CHECKPOINT=path to choose another), twice per split:
# - 512-token blocks scored independently (--context-window 0: no context is carried over from
#   one block to the next, so early tokens of a block see little context). This is the RFA
#   paper's evaluation ("context window 512, not stateful") and the number to compare with it.
# - a sliding window: blocks of 512 tokens whose first CONTEXT_WINDOW (default 400, as fairseq's
#   language-model example) are context only, so every scored token sees at least 400 tokens.
#   Lower perplexity, comparable with fairseq's and Baevski and Auli's way of scoring.
# - RFA runs, a third time: the state carried through the whole split (--task rfa_stateful_lm, one
#   stream of 512-token blocks): every token sees all the text before it. The paper's stateful
#   setting; any RFA checkpoint can be scored so, trained with STATEFUL=1 or not.
# Outputs in $WORK/eval/RUN/ (RUN: the run name given to train.sh, default VARIANT, VARIANT.small
# with SIZE=small).
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wikitext103
select_size big small
select_stateful "${1:-}"
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

# Scorings: cw0 (blocks alone), cw$CONTEXT_WINDOW (sliding window), and for RFA runs "state".
MODES=(0 "$CONTEXT_WINDOW")
[ "$VARIANT" = softmax ] || MODES+=(state)
mode_name() { if [ "$1" = state ]; then echo state; else echo "cw$1"; fi; }

eval_lm() {
  local split=$1 mode=$2 how; shift 2
  if [ "$mode" = state ]; then
    how=(--task rfa_stateful_lm --batch-size 1)
  else
    # --required-batch-size-multiple 1: fairseq would otherwise drop a last partial batch of blocks.
    how=(--task language_modeling --sample-break-mode none --context-window "$mode"
         --max-tokens "${EVAL_MAX_TOKENS:-3072}" --required-batch-size-multiple 1)
  fi
  fairseq-eval-lm "$DATA_BIN" --user-dir "$USER_DIR" --path "$CHECKPOINT" --gen-subset "$split" \
    --tokens-per-sample "$TOKENS_PER_SAMPLE" ${how[@]+"${how[@]}"} --softmax-batch 1024 \
    ${EVAL_ARGS[@]+"${EVAL_ARGS[@]}"} "$@" 2>&1 | tee "$EVAL_DIR/eval_lm.$split.$TAG.$(mode_name "$mode").log"
}

for split in valid test; do
  for mode in ${MODES[@]+"${MODES[@]}"}; do
    step "eval-lm.$RUN.$split.$TAG.$(mode_name "$mode")" eval_lm "$split" "$mode" "$@"
  done
done
log "results ($EVAL_DIR/eval_lm.*.$TAG.*.log):"
for split in valid test; do
  for mode in ${MODES[@]+"${MODES[@]}"}; do
    f=$EVAL_DIR/eval_lm.$split.$TAG.$(mode_name "$mode").log
    ppl=$(grep -o 'Perplexity: [0-9.]*' "$f" | tail -n 1 | cut -d' ' -f2)
    [ -n "$ppl" ] || die "no perplexity in $f"
    if [ "$mode" = 0 ]; then
      how="$TOKENS_PER_SAMPLE-token blocks, --context-window 0 (the RFA paper's setting)"
    elif [ "$mode" = state ]; then
      how="state carried through the split in $TOKENS_PER_SAMPLE-token blocks (--task rfa_stateful_lm, the paper's stateful setting)"
    else
      how="sliding window, --context-window $mode in $TOKENS_PER_SAMPLE-token blocks"
    fi
    echo "$split perplexity, $how: $ppl ($(grep -o 'Evaluated [0-9,]* tokens' "$f" | tail -n 1), $(basename "$CHECKPOINT"))"
  done
done
