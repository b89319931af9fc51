#!/usr/bin/env bash
# Evaluate a trained WMT14 en->de model on newstest2014 (3,003 sentences):
#
#   bash recipes/wmt14_en_de/evaluate.sh VARIANT [extra fairseq-generate flags]
#
# As Vaswani et al. (2017) and the RFA paper: the last 10 update checkpoints averaged
# (scripts/average_checkpoints.py; NUM_AVG to change), beam 4, length penalty 0.6. Reported:
# sacreBLEU against the detokenised references (with its signature), and, as in the paper, BLEU
# on Moses-tokenised text with compound splitting (##AT##-##AT##; tools/score_bleu.py).
# Outputs in $WORK/eval/RUN/ (RUN: the run name given to train.sh, default VARIANT).
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wmt14_en_de
select_size base
set_variant "${1:-}" transformer_wmt_en_de rfa_transformer_wmt_en_de \
  --rfa-causal-feature-dim 64 --rfa-cross-feature-dim 128 --cross-attention rfa
shift
SRC=en TGT=de LENPEN=0.6 TEST_NAME="newstest2014 en-de"
SCORE_ARGS=(--compound-split)
GEN_ARGS=()
if [ "$SMOKE" = 1 ]; then
  NUM_AVG=${NUM_AVG:-3}
  GEN_ARGS=(--cpu --max-len-a 1.2 --max-len-b 10)
fi
evaluate_translation ${GEN_ARGS[@]+"${GEN_ARGS[@]}"} "$@"
