#!/usr/bin/env bash
# IWSLT14 German->English: download, extract, clean, joint sentencepiece model, binarise.
#
#   bash recipes/iwslt14_de_en/prepare.sh                    # downloads de-en.tgz (IWSLT 2014-01, WIT3)
#   RAW_DIR=/data/iwslt14 bash recipes/iwslt14_de_en/prepare.sh  # a folder holding de-en.tgz or its de-en/
#   SMOKE=1 bash recipes/iwslt14_de_en/prepare.sh            # offline stand-in made from data/multi30k
#
# The data as fairseq's examples/translation/prepare-iwslt14.sh makes it (the paper's setup):
# train.tags without its <url>, <talkid> and <keywords> lines and with the <title>/<description>
# tags stripped; pairs of 1-175 words with a length ratio <= 1.5; lower-cased; every 23rd
# training pair is held out as the validation set; the test set is dev2010 + dev2012 (TEDX) +
# tst2010 + tst2011 + tst2012 (6,750 pairs). Differences: the text is not Moses-tokenised
# (sentencepiece reads raw text), so the length filter counts raw words, and a joint sentencepiece
# model of 10k pieces stands in for BPE with 10k merges. As fairseq's example, the source and
# target dictionaries are separate (over the joint subwords).
#
# Output: $WORK/data-bin (fairseq binaries, one dictionary per language), $WORK/spm.model, and the
# detokenised test references $WORK/text/test.{de,en} that evaluate.sh scores against.
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
recipe_init iwslt14_de_en
SRC=de TGT=en
RAW_DIR=${1:-${RAW_DIR:-$WORK/orig}}
VOCAB=${VOCAB:-10000}
LOWERCASE=${LOWERCASE:-1}
TEXT=$WORK/text
TEST_SETS=(TED.dev2010 TEDX.dev2012 TED.tst2010 TED.tst2011 TED.tst2012)
URLS=(
  http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz  # fairseq's copy of the archive
  https://wit3.fbk.eu/archive/2014-01/texts/de/en/de-en.tgz     # the original WIT3 address (no longer answers; last resort)
)

# Smoke mode: a de-en.tgz in the real archive's layout (train.tags with talk headers, dev/test
# XML), from the first Multi30k sentences, so that the steps below run unchanged.
make_smoke_raw() {
  local dir=$RAW_DIR/de-en l set i=0
  mkdir -p "$dir"
  for l in $SRC $TGT; do
    smoke_lines train "$l" 0 400 | awk 'NR % 50 == 1 {
        print "<url>http://www.ted.com/talks/smoke_" NR "</url>"; print "<keywords>talks, smoke</keywords>"
        print "<talkid>" NR "</talkid>"; print "<title>talk " NR "</title>" }
      { print }' > "$dir/train.tags.de-en.$l"
    i=0
    for set in "${TEST_SETS[@]}"; do
      smoke_lines test "$l" $((i * 4)) 4 | awk -v set="IWSLT14.$set" 'BEGIN {
          print "<?xml version=\"1.0\" encoding=\"UTF-8\"?>"; print "<mteval>"
          print "<srcset setid=\"" set "\" srclang=\"german\">"; print "<doc docid=\"1\" genre=\"lectures\">" }
        { print "<seg id=\"" NR "\"> " $0 " </seg>" }
        END { print "</doc>"; print "</srcset>"; print "</mteval>" }' > "$dir/IWSLT14.$set.de-en.$l.xml"
      i=$((i + 1))
    done
  done
  tar -czf "$RAW_DIR/de-en.tgz" -C "$RAW_DIR" de-en
  rm -r "$dir"
}

extract() {
  local orig=$RAW_DIR/de-en l set
  mkdir -p "$TEXT"
  for l in $SRC $TGT; do
    grep -v -e '<url>' -e '<talkid>' -e '<keywords>' "$orig/train.tags.de-en.$l" |
      sed -e 's/<title>//g' -e 's/<\/title>//g' -e 's/<description>//g' -e 's/<\/description>//g' |
      strip_controls > "$TEXT/train.tags.$l"
    for set in "${TEST_SETS[@]}"; do
      grep '<seg id' "$orig/IWSLT14.$set.de-en.$l.xml" |
        sed -e 's/<seg id="[0-9]*">\s*//g' -e 's/\s*<\/seg>\s*//g' -e "s/’/'/g" > "$TEXT/$set.$l"
    done
  done
  count_lines "$TEXT"/train.tags.* "$TEXT"/*.dev2010.*
}

maybe_lowercase() { if [ "$LOWERCASE" = 1 ]; then lowercase; else cat; fi; }

split_sets() {
  clean_pair "$TEXT/train.tags.$SRC" "$TEXT/train.tags.$TGT" "$TEXT/clean.$SRC" "$TEXT/clean.$TGT" 1 175 1.5
  local l set
  for l in $SRC $TGT; do
    maybe_lowercase < "$TEXT/clean.$l" > "$TEXT/all.$l"
    awk 'NR % 23 == 0' "$TEXT/all.$l" > "$TEXT/valid.$l"
    awk 'NR % 23 != 0' "$TEXT/all.$l" > "$TEXT/train.$l"
    for set in "${TEST_SETS[@]}"; do cat "$TEXT/$set.$l"; done | maybe_lowercase > "$TEXT/test.$l"
  done
  count_lines "$TEXT"/{train,valid,test}."$SRC" "$TEXT"/{train,valid,test}."$TGT"
}

encode() {
  mkdir -p "$WORK/spm"
  local args=() split l
  for split in train valid test; do
    for l in $SRC $TGT; do args+=("$TEXT/$split.$l" "$WORK/spm/$split.$l"); done
  done
  spm_encode "$WORK/spm.model" "${args[@]}"
}

binarize() {
  rm -rf "$DATA_BIN"
  fairseq-preprocess --source-lang $SRC --target-lang $TGT \
    --trainpref "$WORK/spm/train" --validpref "$WORK/spm/valid" --testpref "$WORK/spm/test" \
    --destdir "$DATA_BIN" --workers "${WORKERS:-$(nproc)}" 2>&1 | tee "$WORK/logs/preprocess.log"
  cp "$WORK/spm.model" "$DATA_BIN/"
}

if [ "$SMOKE" = 1 ]; then
  RAW_DIR=$WORK/orig-smoke VOCAB=${SMOKE_VOCAB:-1000}
  step smoke-raw make_smoke_raw
fi
log "raw data folder: $RAW_DIR"
step fetch fetch de-en.tgz de-en/train.tags.de-en.de "${URLS[@]}"
step extract extract
step split split_sets
step spm spm_train "$WORK/spm" "$VOCAB" "$TEXT/train.$SRC" "$TEXT/train.$TGT"
step encode encode
step binarize binarize
log "prepared: $DATA_BIN"
