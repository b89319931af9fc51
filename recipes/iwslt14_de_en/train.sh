#!/usr/bin/env bash
# Train a German->English model on IWSLT14 (after prepare.sh):
#
#   bash recipes/iwslt14_de_en/train.sh VARIANT [extra fairseq-train flags]
#
# VARIANT: softmax   fairseq's transformer_iwslt_de_en
#          rfa       rfa_transformer_iwslt_de_en --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128
#          rfa_gate  the same with --rfa-gate
# All three share the rest of the command: fairseq's IWSLT14 setup (examples/translation/README.md):
# 6+6 layers, 512 dims, FFN 1024, 4 heads, all embeddings shared (joined dictionary), dropout
# 0.3, weight decay 1e-4, Adam (0.9, 0.98), lr 5e-4 with inverse-sqrt decay after 4,000 warm-up
# updates, label smoothing 0.1, 4,096 tokens per batch on one GPU, 50,000 updates (fairseq's
# example trains "to convergence", about 40-60 epochs of 1,100 updates; MAX_UPDATE to change).
# A checkpoint every 1,000 updates, the last 10 kept: evaluate.sh averages them.
#
# Environment: MAX_UPDATE, MAX_TOKENS, UPDATE_FREQ, SEED, FP16=0 (--fp16 is on when a GPU is seen).
# Resuming: run the same command again; fairseq continues from checkpoints/VARIANT/checkpoint_last.pt,
# and a run that reached MAX_UPDATE is skipped (marker .done/train.VARIANT.uMAX_UPDATE).
#
# Multi-GPU: fairseq trains on all visible GPUs (CUDA_VISIBLE_DEVICES to choose them,
# or --distributed-world-size N). This setup is one GPU's batch: on several GPUs the batch grows
# with them (set UPDATE_FREQ / MAX_TOKENS to keep 4,096 tokens per update if you want the same).
# Multi-node (here 2 nodes of 8 GPUs), either with torchrun on every node:
#   WORLD_SIZE=16 LAUNCHER="torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --master-addr HOST0 --master-port 29500" \
#     bash recipes/iwslt14_de_en/train.sh rfa_gate
# or fairseq's own launcher, on node R (0 or 1), with node 0's address:
#   WORLD_SIZE=16 bash recipes/iwslt14_de_en/train.sh rfa_gate --distributed-world-size 16 \
#     --distributed-init-method tcp://HOST0:29500 --distributed-rank $((R * 8))
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init iwslt14_de_en
set_variant "${1:-}" transformer_iwslt_de_en rfa_transformer_iwslt_de_en \
  --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128
shift
[ -f "$DATA_BIN/dict.en.txt" ] || die "no binarised data in $DATA_BIN: run prepare.sh first"

if [ "$SMOKE" = 1 ]; then
  # Tiny model, a few updates on CPU; a checkpoint every 2 updates so that evaluate.sh can average 3.
  MAX_UPDATE=${MAX_UPDATE:-6} MAX_TOKENS=${MAX_TOKENS:-1000} SAVE_INTERVAL=2
  RUN_ARGS=(--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 --decoder-embed-dim 32
            --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64
            --encoder-attention-heads 4 --decoder-attention-heads 4
            --cpu --num-workers 0 --log-interval 1)
else
  MAX_UPDATE=${MAX_UPDATE:-50000} MAX_TOKENS=${MAX_TOKENS:-4096} SAVE_INTERVAL=1000
  RUN_ARGS=(--log-interval 100)
fi
set_batch 1 "$MAX_TOKENS"

train() {
  train_cmd "$DATA_BIN" --user-dir "$USER_DIR" --task translation --source-lang de --target-lang en \
    --arch "$ARCH" "${RFA_ARGS[@]}" --share-all-embeddings --dropout 0.3 --weight-decay 0.0001 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
    --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE" \
    --save-dir "$CKPT_DIR" --save-interval-updates "$SAVE_INTERVAL" --keep-interval-updates 10 \
    --no-epoch-checkpoints --seed "${SEED:-1}" --log-format simple "${FP16_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
}
step "train.$VARIANT.u$MAX_UPDATE" train "$@"
log "checkpoints: $CKPT_DIR"
