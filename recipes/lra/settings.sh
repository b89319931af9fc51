# The LRA recipes' per-task settings (sourced by prepare.sh, train.sh and evaluate.sh after common.sh).
#
# lra_init TASK: checks the task (the scripts' first argument), sets TASK_NAME, and recipe_init.
lra_init() {
  TASK_NAME=$1
  case $TASK_NAME in
    listops|text|retrieval) ;;
    *) TASK=lra die "first argument: the task, one of listops, text, retrieval (got '$TASK_NAME')" ;;
  esac
  recipe_init "lra_$TASK_NAME"
}

# lra_settings TASK ATTENTION: ARCH, RFA_ARGS (the attention flag; run_identity records it), RUN,
# CKPT_DIR, TASK_ARGS (sentence_prediction's flags), and the budget MAX_UPDATE, WARMUP, LR.
LRA_ATTENTIONS="softmax rfa favor lara"
lra_settings() {
  local task=$1 attention=$2
  [[ " $LRA_ATTENTIONS " == *" $attention "* ]] ||
    die "second argument: the encoder attention, one of ${LRA_ATTENTIONS// /, } (got '$attention')"
  VARIANT=$attention
  ARCH=rfa_classifier_lra_$task
  RFA_ARGS=(--encoder-attention "$attention")
  RUN=${RUN:-$attention}
  [[ $RUN =~ ^[A-Za-z0-9][A-Za-z0-9._+-]*$ ]] ||
    die "RUN (the run name) may hold letters, digits and . _ + - and must not start with a sign (got '$RUN')"
  CKPT_DIR=$WORK/checkpoints/$RUN
  # 0.05 / sqrt(warm-up): the peak of LRA's constant * linear_warmup * rsqrt_decay schedule
  local updates
  case $task in
    listops) updates=5000 WARMUP=1000 LR=1.58e-3 CLASSES=10 POSITIONS=2002 ;;
    text) updates=20000 WARMUP=8000 LR=5.59e-4 CLASSES=2 POSITIONS=4002 ;;
    retrieval) updates=5000 WARMUP=8000 LR=5.59e-4 CLASSES=2 POSITIONS=8004 ;;
  esac
  # smoke mode: 6 updates after 2 of warm-up
  if [ "$SMOKE" = 1 ]; then updates=6 WARMUP=2; fi
  MAX_UPDATE=${MAX_UPDATE:-$updates}
  TASK_ARGS=(--task sentence_prediction --num-classes "$CLASSES" --init-token 0 --max-positions "$POSITIONS")
  [ "$task" = retrieval ] && TASK_ARGS+=(--separator-token 0)
  log "task $task, attention $attention, run $RUN: --arch $ARCH ${RFA_ARGS[*]}"
}
