#!/usr/bin/env bash
# Train a WikiText-103 language model (after prepare.sh):
#
#   bash recipes/wikitext103/train.sh VARIANT [extra fairseq-train flags]
#   SIZE=small bash recipes/wikitext103/train.sh VARIANT   # the small model (run name VARIANT.small)
#   STATEFUL=1 bash recipes/wikitext103/train.sh rfa_gate  # the paper's stateful runs (run name VARIANT.stateful)
#
# VARIANT: softmax   fairseq's transformer_lm_wiki103
#          rfa       rfa_transformer_lm_wiki103 (small: rfa_transformer_lm_wiki103_small) --rfa-causal-feature-dim 64
#          rfa_gate  the same with --rfa-gate; the ablations (rfa_gate_paper, rfa_arccos, ...): recipes/README.md
# SIZE=big (default): Baevski and Auli's (2019) adaptive-input model as in fairseq's
# examples/language_model/README.adaptive_inputs.md: 16 layers, 1024 dims, FFN 4096, 8 heads,
# adaptive input and softmax (cutoffs 20000,60000, tied), dropout 0.3 (attention and activation
# 0.1). SIZE=small: the same at 6 layers, 512 dims, FFN 2048, 8 heads (the flags SIZE_ARGS
# below, passed to every variant; recipes/README.md says where these dimensions come from).
# Both: blocks of --tokens-per-sample 512 as in the RFA paper (Baevski and Auli used 3,072);
# NAG, lr 1.0, cosine schedule after 16,000 warm-up updates over the rest of the run (fairseq
# derives the period, MAX_UPDATE - warm-up, when --lr-period-updates is not given), shrink 0.75,
# t-mult 2, clip-norm 0.1; 8 GPUs x 3 x 3,072 tokens per update (on any number of GPUs: see
# set_batch); 150,000 updates, the RFA paper's count for all its language models (MAX_UPDATE to
# change); fp16 on GPU. A checkpoint every 2,000 updates (the last 5 kept, for resuming);
# evaluate.sh scores checkpoint_best.pt.
#
# STATEFUL=1 (RFA variants): --task rfa_stateful_lm instead of language_modeling. Each GPU's batch
# is --batch-size MAX_TOKENS / 512 rows (the same tokens per update) of shuffled blocks, each block
# starting from the state (S, z) every layer builds, without gradient, over the two blocks before it
# in the text (the task's --burn-in-blocks 2); evaluate.sh carries the state through the whole split.
# Environment: SIZE, STATEFUL, RUN (run name, default VARIANT, VARIANT.small with SIZE=small), MAX_UPDATE,
# WARMUP, MAX_TOKENS, UPDATE_FREQ, SEED, WORLD_SIZE, LAUNCHER, FP16=0, DRY_RUN=1 (print the
# command only).
# Resuming: run the same command again; fairseq continues from checkpoints/RUN/checkpoint_last.pt,
# and a run that reached MAX_UPDATE is skipped (marker .done/train.RUN.uMAX_UPDATE). A run started
# with other flags is refused: give the new one its own RUN.
# Multi-GPU and multi-node: recipes/README.md.
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wikitext103
select_size big small
select_stateful "${1:-}"
if [ "$SIZE" = small ]; then
  set_variant "${1:-}" transformer_lm_wiki103 rfa_transformer_lm_wiki103_small --rfa-causal-feature-dim 64
  SIZE_ARGS=(--decoder-layers 6 --decoder-embed-dim 512 --decoder-input-dim 512 --decoder-output-dim 512
             --decoder-ffn-embed-dim 2048 --decoder-attention-heads 8)
else
  set_variant "${1:-}" transformer_lm_wiki103 rfa_transformer_lm_wiki103 --rfa-causal-feature-dim 64
fi
shift
[ -f "$DATA_BIN/dict.txt" ] || die "no binarised data in $DATA_BIN: run prepare.sh first"

if [ "$SMOKE" = 1 ]; then
  # Tiny model (its flags come after SIZE_ARGS and win); adaptive cutoffs below the tiny vocabulary.
  MAX_UPDATE=${MAX_UPDATE:-6} TOKENS_PER_SAMPLE=64 WARMUP=2 SAVE_INTERVAL=2 REF_BATCHES=1 GPU_TOKENS=512
  RUN_ARGS=(--decoder-layers 2 --decoder-embed-dim 32 --decoder-input-dim 32 --decoder-output-dim 32
            --decoder-ffn-embed-dim 64 --decoder-attention-heads 4
            --adaptive-input-cutoff 100,500 --adaptive-softmax-cutoff 100,500
            --cpu --num-workers 0 --log-interval 1)
else
  MAX_UPDATE=${MAX_UPDATE:-150000} TOKENS_PER_SAMPLE=512 WARMUP=${WARMUP:-16000}
  SAVE_INTERVAL=2000 REF_BATCHES=24 GPU_TOKENS=3072
  RUN_ARGS=(--log-interval 100)
fi
[ "$MAX_UPDATE" -gt "$WARMUP" ] || die "MAX_UPDATE ($MAX_UPDATE) must exceed the warm-up (WARMUP=$WARMUP updates)"
set_batch "$REF_BATCHES" "$GPU_TOKENS" "$TOKENS_PER_SAMPLE" "$@"
if [ "$STATEFUL" = 1 ]; then
  # --max-tokens (also passed) plays no part in this task: the rows are its batch.
  TASK_ARGS=(--task rfa_stateful_lm --batch-size $((MAX_TOKENS / TOKENS_PER_SAMPLE)))
else
  TASK_ARGS=(--task language_modeling --sample-break-mode none)
fi

train() {
  train_cmd "$DATA_BIN" --user-dir "$USER_DIR" ${TASK_ARGS[@]+"${TASK_ARGS[@]}"} \
    --arch "$ARCH" ${RFA_ARGS[@]+"${RFA_ARGS[@]}"} --tokens-per-sample "$TOKENS_PER_SAMPLE" \
    --criterion adaptive_loss --optimizer nag --clip-norm 0.1 \
    --lr 1.0 --lr-scheduler cosine --warmup-updates "$WARMUP" --warmup-init-lr 1e-07 \
    --t-mult 2 --lr-shrink 0.75 --min-lr 0.0001 --stop-min-lr 1e-09 \
    --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE" \
    --skip-invalid-size-inputs-valid-test --ddp-backend legacy_ddp \
    --save-dir "$CKPT_DIR" --save-interval-updates "$SAVE_INTERVAL" --keep-interval-updates 5 \
    --no-epoch-checkpoints --seed "$SEED" --log-format simple ${FP16_ARGS[@]+"${FP16_ARGS[@]}"} \
    ${SIZE_ARGS[@]+"${SIZE_ARGS[@]}"} "${RUN_ARGS[@]}" "$@"
}
train_run "$@"
