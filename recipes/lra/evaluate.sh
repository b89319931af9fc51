#!/usr/bin/env bash
# Test accuracy of a trained Long Range Arena classifier (after train.sh):
#
#   bash recipes/lra/evaluate.sh TASK ATTENTION [extra fairseq-validate flags]
#
# fairseq-validate with sentence_prediction's criterion on the test split, with the checkpoint of
# the best validation accuracy (checkpoint_best.pt; CHECKPOINT=<file name> for another one in the
# run's folder). Every test example is scored (--required-batch-size-multiple 1). The result
# line goes to $WORK/eval/RUN/test.uUPDATES.txt and is printed; it is tied to the newest
# checkpoint, so training further and evaluating again scores again.
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
. "$RECIPES/lra/settings.sh"
lra_init "${1:-}"
lra_settings "$TASK_NAME" "${2:-}"
shift 2
CKPT=$CKPT_DIR/${CHECKPOINT:-checkpoint_best.pt}
[ -f "$CKPT" ] || die "no $CKPT: run train.sh $TASK_NAME $VARIANT first (with the same RUN)"
LAST=$(newest_update "$CKPT_DIR")
EVAL_DIR=$WORK/eval/$RUN
RESULTS=$EVAL_DIR/test.u${LAST:-0}.txt
EVAL_ARGS=()
[ "$SMOKE" = 1 ] && EVAL_ARGS=(--cpu --num-workers 0)

score_test() {
  mkdir -p "$EVAL_DIR"
  # --criterion: fairseq-validate does not otherwise define the criterion section that
  # sentence_prediction's configuration refers to (criterion.classification_head_name)
  fairseq-validate "$DATA_BIN" --user-dir "$USER_DIR" --task sentence_prediction --criterion sentence_prediction \
    --path "$CKPT" \
    --valid-subset test --batch-size "${EVAL_BATCH_SIZE:-32}" --required-batch-size-multiple 1 \
    --log-format simple ${EVAL_ARGS[@]+"${EVAL_ARGS[@]}"} "$@" 2>&1 | tee "$WORK/logs/validate.$RUN.log"
  local line
  line=$(grep "valid on 'test' subset" "$WORK/logs/validate.$RUN.log" | tail -n 1 | sed 's/.*| valid on/valid on/')
  [ -n "$line" ] || die "fairseq-validate printed no result (log: $WORK/logs/validate.$RUN.log)"
  echo "$TASK_NAME $RUN ($(basename "$CKPT"), update ${LAST:-?}): $line" > "$RESULTS"
}
step "evaluate.$RUN.u${LAST:-0}.$(basename "$CKPT" .pt)" score_test "$@"
log "results ($RESULTS):"
cat "$RESULTS"
