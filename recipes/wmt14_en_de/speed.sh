#!/usr/bin/env bash
# Decoding speed and memory of the trained models on newstest2014 (the RFA paper's speed
# comparison, on the recipe's models; bench/ measures the same with random weights and forced
# lengths):
#
#   bash recipes/wmt14_en_de/speed.sh [RUN...] [-- extra fairseq-generate flags]
#
# RUN: run names (default softmax rfa rfa_gate; the first is the
# reference of the ratios). Each model is the averaged checkpoint of evaluate.sh (else
# checkpoint_last.pt) and decodes the whole test set as evaluate.sh does: beam 4, length penalty
# 0.6, the lengths the model itself produces, GEN_MAX_TOKENS tokens per batch (default 8000).
# REPEATS=N decodes N times per model, taking turns, and keeps the median. Writes
# $WORK/eval/speed.md (the table, with the device) and speed.json (bench/decode.py checkpoint).
# Measure on a machine nothing else runs on.
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wmt14_en_de
select_size base
SRC=en TGT=de LENPEN=0.6
[ -f "$DATA_BIN/dict.de.txt" ] || die "no binarised data in $DATA_BIN: run prepare.sh first"
speed_table "$@"
