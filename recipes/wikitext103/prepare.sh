#!/usr/bin/env bash
# WikiText-103 (word level): download, binarise with its own vocabulary.
#
#   bash recipes/wikitext103/prepare.sh                      # downloads wikitext-103-v1.zip (181 MB)
#   RAW_DIR=/data/wt103 bash recipes/wikitext103/prepare.sh  # a folder holding the zip or its wikitext-103/
#   SMOKE=1 bash recipes/wikitext103/prepare.sh              # offline stand-in made from data/multi30k
#
# As Baevski and Auli (2019) and fairseq's examples/language_model: the tokenised files
# wiki.{train,valid,test}.tokens as they are (no subwords; <unk> already in the text), binarised
# with fairseq-preprocess --only-source, whose dictionary is the 267,735 word types of the
# training set (plus fairseq's specials). Output: $WORK/data-bin.
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init wikitext103
RAW_DIR=${1:-${RAW_DIR:-$WORK/orig}}
URLS=(
  https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip  # the original (fairseq's script)
  https://wikitext.smerity.com/wikitext-103-v1.zip                            # where its author hosts it now
)
SRC_DIR=$RAW_DIR/wikitext-103

# Smoke mode: a wikitext-103-v1.zip in the real layout (" = Title = " headings, paragraphs with
# spaces around them) whose articles are Multi30k captions, 10 to a paragraph.
make_smoke_raw() {
  mkdir -p "$SRC_DIR"
  local split name source lines
  for split in train:train:600 valid:valid:60 test:test:60; do
    IFS=: read -r name source lines <<< "$split"
    smoke_lines "$source" en 0 "$lines" | awk '
      NR % 30 == 1 { print " "; print " = Smoke article " (NR + 29) / 30 " = "; print " " }
      { para = para " " $0 } NR % 10 == 0 { print para " "; para = "" }' > "$SRC_DIR/wiki.$name.tokens"
  done
  (cd "$RAW_DIR" && python -m zipfile -c wikitext-103-v1.zip wikitext-103)
  rm -r "$SRC_DIR"
}

binarize() {
  count_lines "$SRC_DIR"/wiki.{train,valid,test}.tokens
  rm -rf "$DATA_BIN"
  fairseq-preprocess --only-source --trainpref "$SRC_DIR/wiki.train.tokens" \
    --validpref "$SRC_DIR/wiki.valid.tokens" --testpref "$SRC_DIR/wiki.test.tokens" \
    --destdir "$DATA_BIN" --workers "${WORKERS:-$(nproc)}" 2>&1 | tee "$WORK/logs/preprocess.log"
  log "dictionary: $(wc -l < "$DATA_BIN/dict.txt") words"
}

if [ "$SMOKE" = 1 ]; then
  RAW_DIR=$WORK/orig-smoke SRC_DIR=$WORK/orig-smoke/wikitext-103
  step smoke-raw make_smoke_raw
fi
log "raw data folder: $RAW_DIR"
step fetch fetch wikitext-103-v1.zip wikitext-103/wiki.train.tokens "${URLS[@]}"
step binarize binarize
log "prepared: $DATA_BIN"
