#!/usr/bin/env bash
# Train an English->German transformer-base model on WMT14 (after prepare.sh):
#
#   bash recipes/wmt14_en_de/train.sh VARIANT [extra fairseq-train flags]
#
# VARIANT: softmax   fairseq's transformer_wmt_en_de
#          rfa       rfa_transformer_wmt_en_de --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128
#          rfa_gate  the same with --rfa-gate
# The rest is the transformer-base setup of Vaswani et al. (2017), as fairseq runs it (Ott et al.
# 2018): 6+6 layers, 512 dims, FFN 2048, 8 heads, all embeddings shared, dropout 0.1, label
# smoothing 0.1, Adam (0.9, 0.98), lr 7e-4 (Vaswani's d^-0.5 * warmup^-0.5 peak) with
# inverse-sqrt decay after 4,000 warm-up updates, batches of 8 x 4,096 tokens (about Vaswani's
# 25k source + 25k target tokens; --update-freq makes up for fewer GPUs), 100,000 updates
# (Vaswani's base schedule; MAX_UPDATE to change), fp16 on GPU. A checkpoint every 1,000 updates,
# the last 10 kept: evaluate.sh averages them.
#
# Environment: MAX_UPDATE, MAX_TOKENS, UPDATE_FREQ, SEED, WORLD_SIZE, LAUNCHER, FP16=0.
# Resuming: run the same command again; fairseq continues from checkpoints/VARIANT/checkpoint_last.pt,
# and a run that reached MAX_UPDATE is skipped (marker .done/train.VARIANT.uMAX_UPDATE).
#
# Multi-GPU: fairseq trains on all visible GPUs (CUDA_VISIBLE_DEVICES to choose them, or
# --distributed-world-size N); UPDATE_FREQ is 8 / (number of GPUs) so the batch stays the same.
# Multi-node (here 2 nodes of 8 GPUs), either with torchrun on every node:
#   WORLD_SIZE=16 LAUNCHER="torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --master-addr HOST0 --master-port 29500" \
#     bash recipes/wmt14_en_de/train.sh rfa_gate
# or fairseq's own launcher, on node R (0 or 1), with node 0's address:
#   WORLD_SIZE=16 bash recipes/wmt14_en_de/train.sh rfa_gate --distributed-world-size 16 \
#     --distributed-init-method tcp://HOST0:29500 --distributed-rank $((R * 8))
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wmt14_en_de
set_variant "${1:-}" transformer_wmt_en_de rfa_transformer_wmt_en_de \
  --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128
shift
[ -f "$DATA_BIN/dict.de.txt" ] || die "no binarised data in $DATA_BIN: run prepare.sh first"

if [ "$SMOKE" = 1 ]; then
  MAX_UPDATE=${MAX_UPDATE:-6} MAX_TOKENS=${MAX_TOKENS:-1000} SAVE_INTERVAL=2 REF_BATCHES=1
  RUN_ARGS=(--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 --decoder-embed-dim 32
            --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64
            --encoder-attention-heads 4 --decoder-attention-heads 4
            --cpu --num-workers 0 --log-interval 1)
else
  MAX_UPDATE=${MAX_UPDATE:-100000} MAX_TOKENS=${MAX_TOKENS:-4096} SAVE_INTERVAL=1000 REF_BATCHES=8
  RUN_ARGS=(--log-interval 100)
fi
set_batch "$REF_BATCHES" "$MAX_TOKENS"

train() {
  train_cmd "$DATA_BIN" --user-dir "$USER_DIR" --task translation --source-lang en --target-lang de \
    --arch "$ARCH" "${RFA_ARGS[@]}" --share-all-embeddings --dropout 0.1 --weight-decay 0.0 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
    --lr 7e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE" \
    --save-dir "$CKPT_DIR" --save-interval-updates "$SAVE_INTERVAL" --keep-interval-updates 10 \
    --no-epoch-checkpoints --seed "${SEED:-1}" --log-format simple "${FP16_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
}
step "train.$VARIANT.u$MAX_UPDATE" train "$@"
log "checkpoints: $CKPT_DIR"
