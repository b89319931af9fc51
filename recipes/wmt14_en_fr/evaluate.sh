#!/usr/bin/env bash
# Evaluate a trained WMT14 en->fr model on newstest2014 (3,003 sentences):
#
#   bash recipes/wmt14_en_fr/evaluate.sh VARIANT [extra fairseq-generate flags]
#   SIZE=big bash recipes/wmt14_en_fr/evaluate.sh VARIANT    # the transformer-big run
#
# As Vaswani et al. (2017) and the RFA paper: the last 10 update checkpoints averaged
# (scripts/average_checkpoints.py; NUM_AVG to change), beam 4, length penalty 0.6. Reported:
# sacreBLEU against the detokenised references (with its signature) and BLEU on Moses-tokenised
# text (compound splitting is an en-de convention). Outputs in $WORK/eval/RUN/ (RUN: the run
# name given to train.sh, default VARIANT, VARIANT.big with SIZE=big).
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wmt14_en_fr
select_size base big
if [ "$SIZE" = big ]; then
  set_variant "${1:-}" transformer_vaswani_wmt_en_fr_big rfa_transformer_vaswani_wmt_en_fr_big
else
  set_variant "${1:-}" transformer_wmt_en_de rfa_transformer_wmt_en_de
fi
shift
SRC=en TGT=fr LENPEN=0.6 TEST_NAME="newstest2014 en-fr"
SCORE_ARGS=(--tokenised)
GEN_ARGS=()
if [ "$SMOKE" = 1 ]; then
  NUM_AVG=${NUM_AVG:-3}
  GEN_ARGS=(--cpu --max-len-a 1.2 --max-len-b 10)
fi
evaluate_translation ${GEN_ARGS[@]+"${GEN_ARGS[@]}"} "$@"
