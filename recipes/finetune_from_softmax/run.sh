#!/usr/bin/env bash
# Convert a trained softmax transformer to RFA-Gate and finetune it (Kasai et al., 2021, "T2R"),
# on Multi30k de-en (data/multi30k):
#
#   bash recipes/finetune_from_softmax/run.sh            # train softmax, convert, score, finetune, score
#   SOFTMAX_CKPT=ckpt.pt bash recipes/finetune_from_softmax/run.sh   # start from your own softmax model
#   SMOKE=1 bash recipes/finetune_from_softmax/run.sh    # tiny data and model, a minute on CPU
#
# Steps (each resumes, see recipes/common.sh): prepare (scripts/prepare_multi30k.sh), softmax
# (fairseq-train transformer_iwslt_de_en, SOFTMAX_UPDATES), convert (scripts/convert_from_softmax.py
# $RFA_FLAGS), score_converted (BLEU before any finetuning), finetune (fairseq-train
# --finetune-from-model, FINETUNE_UPDATES, default a fifth of SOFTMAX_UPDATES), score_finetuned.
# fairseq-train --finetune-from-model builds the model from its own flags: MODEL_ARGS must give the
# softmax model's dimensions (the default ones below when this recipe trained it).
# The trained cross attention is kept as it is (the default); RFA_FLAGS="--rfa-gate --cross-attention rfa"
# replaces it too (the paper's model: it needs longer finetuning, see docs/quality.md).
# Environment: WORK, SEED, SOFTMAX_UPDATES (2000), FINETUNE_UPDATES, RFA_FLAGS ("--rfa-gate"),
# MODEL_ARGS, SOFTMAX_CKPT. Results: $WORK/logs/score_*.log (sacreBLEU on detokenised test).
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init finetune_from_softmax
read -r -a RFA <<< "${RFA_FLAGS:---rfa-gate}"
if [ "$SMOKE" = 1 ]; then
  SOFTMAX_UPDATES=${SOFTMAX_UPDATES:-6}
  read -r -a MODEL <<< "${MODEL_ARGS:---encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 --decoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 --encoder-attention-heads 4 --decoder-attention-heads 4}"
  RUN_FLAGS=(--cpu --num-workers 0 --max-tokens 1000 --log-interval 1 --lr 1e-3 --warmup-updates 2)
  POST=()
else
  SOFTMAX_UPDATES=${SOFTMAX_UPDATES:-2000}
  read -r -a MODEL <<< "${MODEL_ARGS:---encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256 --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 --encoder-attention-heads 4 --decoder-attention-heads 4}"
  RUN_FLAGS=(--max-tokens 4096 --log-interval 50 --lr 2e-3 --warmup-updates 400)
  POST=(--post-process sentencepiece)
fi
FINETUNE_UPDATES=${FINETUNE_UPDATES:-$(( (SOFTMAX_UPDATES + 4) / 5 ))}
DATA=$WORK/data
COMMON=(--user-dir "$USER_DIR" --share-decoder-input-output-embed --dropout 0.3 --weight-decay 0.0001
        --optimizer adam --adam-betas '(0.9, 0.98)' --lr-scheduler inverse_sqrt --criterion label_smoothed_cross_entropy
        --label-smoothing 0.1 --seed "$SEED" --no-epoch-checkpoints --no-progress-bar ${RUN_FLAGS[@]+"${RUN_FLAGS[@]}"} ${MODEL[@]+"${MODEL[@]}"})

prepare() {
  if [ "$SMOKE" = 1 ]; then  # the first lines of the shipped (tokenised) text, no subword model
    mkdir -p "$DATA"
    for split in train:300 valid:30 test:20; do
      for lang in de en; do smoke_lines "${split%:*}" "$lang" 0 "${split#*:}" > "$DATA/${split%:*}.$lang"; done
    done
    fairseq-preprocess --source-lang de --target-lang en --joined-dictionary --workers 1 --trainpref "$DATA/train" \
      --validpref "$DATA/valid" --testpref "$DATA/test" --destdir "$DATA/bin" > "$WORK/logs/prepare.log" 2>&1
  else
    bash "$ROOT/scripts/prepare_multi30k.sh" "$DATA"
  fi
}
score() {  # score NAME CHECKPOINT: beam 4 on test, BLEU as fairseq-generate reports it
  fairseq-generate "$DATA/bin" --user-dir "$USER_DIR" --path "$2" --gen-subset test --beam 4 --batch-size 64 \
    --required-batch-size-multiple 1 ${POST[@]+"${POST[@]}"} $([ "$SMOKE" = 1 ] && echo --cpu --max-len-b 20) \
    > "$WORK/logs/score_$1.log" 2>&1
  log "$1: $(grep -o 'BLEU4 = [0-9.]*' "$WORK/logs/score_$1.log")"
}
train_softmax() {
  fairseq-train "$DATA/bin" --arch transformer_iwslt_de_en ${COMMON[@]+"${COMMON[@]}"} --max-update "$SOFTMAX_UPDATES" \
    --save-dir "$WORK/softmax" > "$WORK/logs/softmax.log" 2>&1
}
finetune() {
  fairseq-train "$DATA/bin" --arch rfa_transformer_iwslt_de_en ${RFA[@]+"${RFA[@]}"} ${COMMON[@]+"${COMMON[@]}"} --max-update "$FINETUNE_UPDATES" \
    --finetune-from-model "$WORK/converted.pt" --save-dir "$WORK/finetuned" > "$WORK/logs/finetune.log" 2>&1
}
SOFTMAX=${SOFTMAX_CKPT:-$WORK/softmax/checkpoint_last.pt}
step prepare prepare
[ -n "${SOFTMAX_CKPT:-}" ] || step softmax train_softmax
step convert python "$ROOT/scripts/convert_from_softmax.py" --input "$SOFTMAX" --output "$WORK/converted.pt" --seed "$SEED" ${RFA[@]+"${RFA[@]}"}
step score_converted score converted "$WORK/converted.pt"
step finetune finetune
step score_finetuned score finetuned "$WORK/finetuned/checkpoint_last.pt"
