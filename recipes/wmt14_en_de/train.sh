#!/usr/bin/env bash
# Train an English->German transformer-base model on WMT14 (after prepare.sh):
#
#   bash recipes/wmt14_en_de/train.sh VARIANT [extra fairseq-train flags]
#
# VARIANT: softmax   fairseq's transformer_wmt_en_de
#          rfa       rfa_transformer_wmt_en_de --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128
#                    --cross-attention rfa (the paper's model; the plugin's default cross attention is softmax)
#          rfa_gate  the same with --rfa-gate; the ablations (rfa_gate_paper, rfa_arccos, ...): recipes/README.md
# The rest is the transformer-base setup of Vaswani et al. (2017), as fairseq runs it (Ott et al.
# 2018): 6+6 layers, 512 dims, FFN 2048, 8 heads, all embeddings shared, dropout 0.1, label
# smoothing 0.1, Adam (0.9, 0.98), lr 7e-4 (Vaswani's d^-0.5 * warmup^-0.5 peak) with
# inverse-sqrt decay after 4,000 warm-up updates, 8 x 4,096 tokens per update (about Vaswani's
# 25k source + 25k target tokens, on any number of GPUs: see set_batch), 350,000 updates (the
# RFA paper's "up to 350K" for its WMT models; MAX_UPDATE to change), fp16 on GPU. A checkpoint
# every 1,000 updates, the last 10 kept: evaluate.sh averages them.
#
# Environment: RUN (run name, default VARIANT: checkpoints/RUN), MAX_UPDATE, MAX_TOKENS,
# UPDATE_FREQ, SEED, WORLD_SIZE, LAUNCHER, FP16=0, DRY_RUN=1 (print the fairseq-train command only).
# Resuming: run the same command again; fairseq continues from checkpoints/RUN/checkpoint_last.pt,
# and a run that reached MAX_UPDATE is skipped (marker .done/train.RUN.uMAX_UPDATE). A run started
# with other flags is refused: give the new one its own RUN.
# Multi-GPU and multi-node: recipes/README.md.
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wmt14_en_de
select_size base
set_variant "${1:-}" transformer_wmt_en_de rfa_transformer_wmt_en_de \
  --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128 --cross-attention rfa
shift
[ -f "$DATA_BIN/dict.de.txt" ] || die "no binarised data in $DATA_BIN: run prepare.sh first"

if [ "$SMOKE" = 1 ]; then
  MAX_UPDATE=${MAX_UPDATE:-6} SAVE_INTERVAL=2 REF_BATCHES=1 GPU_TOKENS=1000
  RUN_ARGS=(--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 --decoder-embed-dim 32
            --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64
            --encoder-attention-heads 4 --decoder-attention-heads 4
            --cpu --num-workers 0 --log-interval 1)
else
  MAX_UPDATE=${MAX_UPDATE:-350000} SAVE_INTERVAL=1000 REF_BATCHES=8 GPU_TOKENS=4096
  RUN_ARGS=(--log-interval 100)
fi
set_batch "$REF_BATCHES" "$GPU_TOKENS" 1 "$@"

train() {
  train_cmd "$DATA_BIN" --user-dir "$USER_DIR" --task translation --source-lang en --target-lang de \
    --arch "$ARCH" ${RFA_ARGS[@]+"${RFA_ARGS[@]}"} --share-all-embeddings --dropout 0.1 --weight-decay 0.0 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
    --lr 7e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE" \
    --save-dir "$CKPT_DIR" --save-interval-updates "$SAVE_INTERVAL" --keep-interval-updates 10 \
    --no-epoch-checkpoints --seed "$SEED" --log-format simple ${FP16_ARGS[@]+"${FP16_ARGS[@]}"} "${RUN_ARGS[@]}" "$@"
}
train_run "$@"
