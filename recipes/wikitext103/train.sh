#!/usr/bin/env bash
# Train a WikiText-103 language model (after prepare.sh):
#
#   bash recipes/wikitext103/train.sh VARIANT [extra fairseq-train flags]
#
# VARIANT: softmax   fairseq's transformer_lm_wiki103
#          rfa       rfa_transformer_lm_wiki103 --rfa-causal-feature-dim 64
#          rfa_gate  the same with --rfa-gate
# The model and schedule of Baevski and Auli (2019) as in fairseq's
# examples/language_model/README.adaptive_inputs.md: 16 layers, 1024 dims, FFN 4096, 8 heads,
# adaptive input and softmax (cutoffs 20000,60000, tied), dropout 0.3; NAG, lr 1.0, cosine
# schedule (period MAX_UPDATE - 16,000 updates, shrink 0.75, t-mult 2) after 16,000 warm-up
# updates, clip-norm 0.1, batches of 8 GPUs x 3,072 tokens x update-freq 3, 286,000 updates
# (Baevski and Auli's schedule; MAX_UPDATE to change), fp16 on GPU. As in the RFA paper, blocks
# of --tokens-per-sample 512 (Baevski and Auli used 3,072). A checkpoint every 2,000 updates (the
# last 5 kept, for resuming); evaluate.sh scores checkpoint_best.pt.
#
# Environment: MAX_UPDATE, WARMUP, MAX_TOKENS, UPDATE_FREQ, SEED, WORLD_SIZE, LAUNCHER, FP16=0.
# Resuming: run the same command again; fairseq continues from checkpoints/VARIANT/checkpoint_last.pt,
# and a run that reached MAX_UPDATE is skipped (marker .done/train.VARIANT.uMAX_UPDATE).
#
# Multi-GPU: fairseq trains on all visible GPUs (CUDA_VISIBLE_DEVICES to choose them, or
# --distributed-world-size N); UPDATE_FREQ is 24 / (number of GPUs) so the batch stays the same.
# Multi-node (here 2 nodes of 8 GPUs), either with torchrun on every node:
#   WORLD_SIZE=16 LAUNCHER="torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --master-addr HOST0 --master-port 29500" \
#     bash recipes/wikitext103/train.sh rfa_gate
# or fairseq's own launcher, on node R (0 or 1), with node 0's address:
#   WORLD_SIZE=16 bash recipes/wikitext103/train.sh rfa_gate --distributed-world-size 16 \
#     --distributed-init-method tcp://HOST0:29500 --distributed-rank $((R * 8))
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wikitext103
set_variant "${1:-}" transformer_lm_wiki103 rfa_transformer_lm_wiki103 --rfa-causal-feature-dim 64
shift
[ -f "$DATA_BIN/dict.txt" ] || die "no binarised data in $DATA_BIN: run prepare.sh first"

if [ "$SMOKE" = 1 ]; then
  # Tiny model; adaptive input/softmax cutoffs below the tiny vocabulary.
  MAX_UPDATE=${MAX_UPDATE:-6} MAX_TOKENS=${MAX_TOKENS:-512} TOKENS_PER_SAMPLE=64 WARMUP=2
  SAVE_INTERVAL=2 REF_BATCHES=1
  RUN_ARGS=(--decoder-layers 2 --decoder-embed-dim 32 --decoder-input-dim 32 --decoder-output-dim 32
            --decoder-ffn-embed-dim 64 --decoder-attention-heads 4
            --adaptive-input-cutoff 100,500 --adaptive-softmax-cutoff 100,500
            --cpu --num-workers 0 --log-interval 1)
else
  MAX_UPDATE=${MAX_UPDATE:-286000} MAX_TOKENS=${MAX_TOKENS:-3072} TOKENS_PER_SAMPLE=512 WARMUP=${WARMUP:-16000}
  SAVE_INTERVAL=2000 REF_BATCHES=24
  RUN_ARGS=(--log-interval 100)
fi
set_batch "$REF_BATCHES" "$MAX_TOKENS"
[ "$MAX_UPDATE" -gt "$WARMUP" ] || die "MAX_UPDATE ($MAX_UPDATE) must exceed the warm-up (WARMUP=$WARMUP updates)"

train() {
  train_cmd "$DATA_BIN" --user-dir "$USER_DIR" --task language_modeling \
    --arch "$ARCH" "${RFA_ARGS[@]}" --tokens-per-sample "$TOKENS_PER_SAMPLE" --sample-break-mode none \
    --criterion adaptive_loss --optimizer nag --clip-norm 0.1 \
    --lr 1.0 --lr-scheduler cosine --warmup-updates "$WARMUP" --warmup-init-lr 1e-07 \
    --lr-period-updates $((MAX_UPDATE - WARMUP)) --t-mult 2 --lr-shrink 0.75 --min-lr 0.0001 --stop-min-lr 1e-09 \
    --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE" \
    --skip-invalid-size-inputs-valid-test --ddp-backend legacy_ddp \
    --save-dir "$CKPT_DIR" --save-interval-updates "$SAVE_INTERVAL" --keep-interval-updates 5 \
    --no-epoch-checkpoints --seed "${SEED:-1}" --log-format simple "${FP16_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
}
step "train.$VARIANT.u$MAX_UPDATE" train "$@"
log "checkpoints: $CKPT_DIR"
