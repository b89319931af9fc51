#!/usr/bin/env bash
# Train an English->French model on WMT14 (after prepare.sh), transformer-base as in the RFA paper:
#
#   bash recipes/wmt14_en_fr/train.sh VARIANT [extra fairseq-train flags]
#   SIZE=big bash recipes/wmt14_en_fr/train.sh VARIANT     # transformer-big (run name VARIANT.big)
#
# VARIANT: softmax   fairseq's transformer_wmt_en_de (big: transformer_vaswani_wmt_en_fr_big)
#          rfa       rfa_transformer_wmt_en_de (big: rfa_transformer_vaswani_wmt_en_fr_big)
#                    --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128 --cross-attention rfa
#          rfa_gate  the same with --rfa-gate; the ablations (rfa_gate_paper, rfa_arccos, ...): recipes/README.md
# SIZE=base (default): the RFA paper builds its translation models on transformer-base; the
# setup is the en-de recipe's (Vaswani et al. 2017 as fairseq runs it): 6+6 layers, 512 dims,
# FFN 2048, 8 heads, all embeddings shared, dropout 0.1, label smoothing 0.1, Adam (0.9, 0.98),
# lr 7e-4 with inverse-sqrt decay after 4,000 warm-up updates, 8 x 4,096 tokens per update.
# SIZE=big: Ott et al. (2018, examples/scaling_nmt): 6+6 layers, 1024 dims, FFN 4096, 16 heads,
# lr 5e-4, 8 x 3,584 tokens per update, otherwise the same. Both: 350,000 updates (the RFA
# paper's "up to 350K" for its WMT models; MAX_UPDATE to change), fp16 on GPU, a checkpoint every
# 1,000 updates, the last 10 kept: evaluate.sh averages them.
#
# Environment: SIZE, RUN (run name, default VARIANT, VARIANT.big with SIZE=big), MAX_UPDATE,
# MAX_TOKENS, UPDATE_FREQ, SEED, WORLD_SIZE, LAUNCHER, FP16=0, DRY_RUN=1 (print the command only).
# Resuming: run the same command again; fairseq continues from checkpoints/RUN/checkpoint_last.pt,
# and a run that reached MAX_UPDATE is skipped (marker .done/train.RUN.uMAX_UPDATE). A run started
# with other flags is refused: give the new one its own RUN.
# Multi-GPU and multi-node: recipes/README.md.
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wmt14_en_fr
select_size base big
if [ "$SIZE" = big ]; then
  set_variant "${1:-}" transformer_vaswani_wmt_en_fr_big rfa_transformer_vaswani_wmt_en_fr_big \
    --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128 --cross-attention rfa
  LR=5e-4 GPU_TOKENS=3584
else
  set_variant "${1:-}" transformer_wmt_en_de rfa_transformer_wmt_en_de \
    --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128 --cross-attention rfa
  LR=7e-4 GPU_TOKENS=4096
fi
shift
[ -f "$DATA_BIN/dict.fr.txt" ] || die "no binarised data in $DATA_BIN: run prepare.sh first"

if [ "$SMOKE" = 1 ]; then
  MAX_UPDATE=${MAX_UPDATE:-6} SAVE_INTERVAL=2 REF_BATCHES=1 GPU_TOKENS=1000
  RUN_ARGS=(--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 --decoder-embed-dim 32
            --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64
            --encoder-attention-heads 4 --decoder-attention-heads 4
            --cpu --num-workers 0 --log-interval 1)
else
  MAX_UPDATE=${MAX_UPDATE:-350000} SAVE_INTERVAL=1000 REF_BATCHES=8
  RUN_ARGS=(--log-interval 100)
fi
set_batch "$REF_BATCHES" "$GPU_TOKENS" 1 "$@"

train() {
  train_cmd "$DATA_BIN" --user-dir "$USER_DIR" --task translation --source-lang en --target-lang fr \
    --arch "$ARCH" ${RFA_ARGS[@]+"${RFA_ARGS[@]}"} --share-all-embeddings --dropout 0.1 --weight-decay 0.0 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE" \
    --save-dir "$CKPT_DIR" --save-interval-updates "$SAVE_INTERVAL" --keep-interval-updates 10 \
    --no-epoch-checkpoints --seed "$SEED" --log-format simple ${FP16_ARGS[@]+"${FP16_ARGS[@]}"} "${RUN_ARGS[@]}" "$@"
}
train_run "$@"
