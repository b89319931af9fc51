#!/usr/bin/env bash
# Evaluate a trained IWSLT14 de->en model on the test set (6,750 sentences):
#
#   bash recipes/iwslt14_de_en/evaluate.sh VARIANT [extra fairseq-generate flags]
#
# The last 10 update checkpoints averaged (scripts/average_checkpoints.py; NUM_AVG to change),
# fairseq-generate with beam 4 (length penalty 1, fairseq's default), sentencepiece removed
# (--post-process sentencepiece), then sacreBLEU against the detokenised (lower-cased, as the
# data) references with its signature, and BLEU on Moses-tokenised text (the number IWSLT14
# papers give, fairseq's example included). Outputs in $WORK/eval/RUN/ (RUN: the run name
# given to train.sh, default VARIANT).
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init iwslt14_de_en
select_size base
set_variant "${1:-}" transformer_iwslt_de_en rfa_transformer_iwslt_de_en \
  --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128 --cross-attention rfa
shift
SRC=de TGT=en LENPEN=1.0 TEST_NAME="IWSLT14 de-en test"
SCORE_ARGS=(--tokenised)
GEN_ARGS=()
if [ "$SMOKE" = 1 ]; then
  NUM_AVG=${NUM_AVG:-3}
  GEN_ARGS=(--cpu --max-len-a 1.2 --max-len-b 10)
fi
evaluate_translation ${GEN_ARGS[@]+"${GEN_ARGS[@]}"} "$@"
