#!/usr/bin/env bash
# Train a Long Range Arena classifier (after prepare.sh) with fairseq's sentence_prediction task:
#
#   bash recipes/lra/train.sh TASK ATTENTION [extra fairseq-train flags]
#
# TASK: listops, text or retrieval. ATTENTION: the encoder's self-attention, softmax, rfa, favor
# or lara (--encoder-attention; the run is named after it unless RUN is given). The model is
# --arch rfa_classifier_lra_TASK, the LRA paper's encoder for the task (rfa_fairseq/models/
# rfa_classifier.py); the budget is LRA's (google-research/long-range-arena configs, commit
# cd31e5c): 32 examples per update, Adam (0.9, 0.98, eps 1e-9) with decoupled weight decay 0.1,
# LRA's "constant 0.05 * linear warm-up * rsqrt decay" as fairseq's inverse_sqrt with the same
# peak (--lr 0.05 / sqrt(warm-up)):
#   listops    5,000 updates, warm-up 1,000 (lr 1.58e-3), <= 2,000 tokens, 10 classes
#   text      20,000 updates, warm-up 8,000 (lr 5.59e-4), <= 4,000 bytes,   2 classes
#   retrieval  5,000 updates, warm-up 8,000 (lr 5.59e-4, so still warming up at the end, as LRA),
#              two documents of <= 4,000 bytes, dual encoder, 2 classes
# The first position is <s> (--init-token 0; the second document of a pair starts with it too,
# --separator-token 0): the classifier reads it (--classifier-pooling cls, LRA's CLS pooling).
# Validation (accuracy) and a checkpoint every 500 updates; checkpoint_best.pt is the one with
# the best validation accuracy, which evaluate.sh scores on the test set.
#
# Environment: RUN, MAX_UPDATE, BATCH_SIZE (per GPU; default 32 / number of GPUs), SEED,
# WORLD_SIZE, LAUNCHER, FP16=0 (--fp16 is on when a GPU is seen), DRY_RUN=1 (print the command).
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
. "$RECIPES/lra/settings.sh"
lra_init "${1:-}"
lra_settings "$TASK_NAME" "${2:-}"
shift 2
[ -f "$DATA_BIN/input0/dict.txt" ] || die "no binarised data in $DATA_BIN: run prepare.sh $TASK_NAME first"

if [ "$SMOKE" = 1 ]; then
  # Tiny model, a few updates on CPU, a checkpoint (and validation) every 2 updates.
  INTERVAL=2 BATCH=8
  RUN_ARGS=(--encoder-layers 1 --encoder-embed-dim 32 --encoder-ffn-embed-dim 64 --encoder-attention-heads 4
            --cpu --num-workers 0 --log-interval 1)
  case $VARIANT in
    rfa|favor) RUN_ARGS+=(--encoder-feature-dim 16) ;;
    lara) RUN_ARGS+=(--lara-landmarks 4) ;;
  esac
else
  INTERVAL=500 BATCH=32
  RUN_ARGS=(--log-interval 50)
fi
WORLD=$(world_size "$@")
if [ -z "${BATCH_SIZE:-}" ]; then
  [ $((BATCH % WORLD)) = 0 ] || die "LRA's $BATCH examples per update do not split over $WORLD GPUs: give BATCH_SIZE (per GPU)"
  BATCH_SIZE=$((BATCH / WORLD))
fi
FP16_ARGS=()
if [ "${FP16:-1}" = 1 ] && [ "$(gpu_count)" -gt 0 ]; then FP16_ARGS=(--fp16); fi
log "batch: $WORLD GPU(s) x --batch-size $BATCH_SIZE = $((WORLD * BATCH_SIZE)) examples per update (LRA: $BATCH)"

train() {
  train_cmd "$DATA_BIN" --user-dir "$USER_DIR" ${TASK_ARGS[@]+"${TASK_ARGS[@]}"} --arch "$ARCH" ${RFA_ARGS[@]+"${RFA_ARGS[@]}"} \
    --criterion sentence_prediction --optimizer adam --adam-betas '(0.9, 0.98)' --adam-eps 1e-9 \
    --weight-decay 0.1 --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" \
    --batch-size "$BATCH_SIZE" --required-batch-size-multiple 1 --max-update "$MAX_UPDATE" \
    --save-dir "$CKPT_DIR" --save-interval-updates "$INTERVAL" --validate-interval-updates "$INTERVAL" \
    --keep-interval-updates 1 --no-epoch-checkpoints --best-checkpoint-metric accuracy \
    --maximize-best-checkpoint-metric --seed "$SEED" --log-format simple ${FP16_ARGS[@]+"${FP16_ARGS[@]}"} \
    "${RUN_ARGS[@]}" "$@"
}
train_run "$@"
