#!/usr/bin/env bash
# Train a German->English model on IWSLT14 (after prepare.sh):
#
#   bash recipes/iwslt14_de_en/train.sh VARIANT [extra fairseq-train flags]
#
# VARIANT: softmax   fairseq's transformer_iwslt_de_en
#          rfa       rfa_transformer_iwslt_de_en --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128
#                    --cross-attention rfa (the paper's model; the plugin's default cross attention is softmax)
#          rfa_gate  the same with --rfa-gate; the ablations (rfa_gate_paper, rfa_arccos, ...): recipes/README.md
# All share the rest of the command, fairseq's IWSLT14 example (examples/translation/README.md):
# 6+6 layers, 512 dims, FFN 1024, 4 heads, separate source and target dictionaries (over one joint
# subword model) with the decoder's input and output embeddings shared, dropout 0.3, weight decay
# 1e-4, Adam (0.9, 0.98), lr 5e-4 with inverse-sqrt decay after 4,000 warm-up updates, label
# smoothing 0.1, 4,096 tokens per update (one GPU's batch: on several GPUs each gets a share,
# see set_batch), 50,000 updates (fairseq's example trains "to convergence", about 40-60 epochs
# of 1,100 updates; MAX_UPDATE to change). A checkpoint every 1,000 updates, the last 10 kept:
# evaluate.sh averages them.
#
# Environment: RUN (run name, default VARIANT: checkpoints/RUN), MAX_UPDATE, MAX_TOKENS,
# UPDATE_FREQ, SEED, WORLD_SIZE, LAUNCHER, FP16=0 (--fp16 is on when a GPU is seen), DRY_RUN=1
# (print the fairseq-train command only).
# Resuming: run the same command again; fairseq continues from checkpoints/RUN/checkpoint_last.pt,
# and a run that reached MAX_UPDATE is skipped (marker .done/train.RUN.uMAX_UPDATE). A run started
# with other flags is refused: give the new one its own RUN.
# Multi-GPU and multi-node: recipes/README.md.
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init iwslt14_de_en
select_size base
set_variant "${1:-}" transformer_iwslt_de_en rfa_transformer_iwslt_de_en \
  --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128 --cross-attention rfa
shift
[ -f "$DATA_BIN/dict.en.txt" ] || die "no binarised data in $DATA_BIN: run prepare.sh first"

if [ "$SMOKE" = 1 ]; then
  # Tiny model, a few updates on CPU; a checkpoint every 2 updates so that evaluate.sh can average 3.
  MAX_UPDATE=${MAX_UPDATE:-6} SAVE_INTERVAL=2 REF_BATCHES=1 GPU_TOKENS=1000
  RUN_ARGS=(--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 --decoder-embed-dim 32
            --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64
            --encoder-attention-heads 4 --decoder-attention-heads 4
            --cpu --num-workers 0 --log-interval 1)
else
  MAX_UPDATE=${MAX_UPDATE:-50000} SAVE_INTERVAL=1000 REF_BATCHES=1 GPU_TOKENS=4096
  RUN_ARGS=(--log-interval 100)
fi
set_batch "$REF_BATCHES" "$GPU_TOKENS" 1 "$@"

train() {
  train_cmd "$DATA_BIN" --user-dir "$USER_DIR" --task translation --source-lang de --target-lang en \
    --arch "$ARCH" ${RFA_ARGS[@]+"${RFA_ARGS[@]}"} --share-decoder-input-output-embed \
    --dropout 0.3 --weight-decay 0.0001 --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
    --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE" \
    --save-dir "$CKPT_DIR" --save-interval-updates "$SAVE_INTERVAL" --keep-interval-updates 10 \
    --no-epoch-checkpoints --seed "$SEED" --log-format simple ${FP16_ARGS[@]+"${FP16_ARGS[@]}"} "${RUN_ARGS[@]}" "$@"
}
train_run "$@"
