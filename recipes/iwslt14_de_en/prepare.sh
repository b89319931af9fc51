#!/usr/bin/env bash
# IWSLT14 German->English: download, extract, clean, joint sentencepiece model, binarise.
#
#   bash recipes/iwslt14_de_en/prepare.sh                    # downloads de-en.tgz (IWSLT 2014-01, WIT3)
#   RAW_DIR=/data/iwslt14 bash recipes/iwslt14_de_en/prepare.sh  # a folder holding de-en.tgz or its de-en/
#   SMOKE=1 bash recipes/iwslt14_de_en/prepare.sh            # offline stand-in made from data/multi30k
#   DOCS=1 bash recipes/iwslt14_de_en/prepare.sh             # also document-level data (below)
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
#
# DOCS=1 adds document-level data, one document per talk, after the sentence-level steps (which
# it leaves as they are). Every sentence gets the id of its talk (in train.tags a talk begins at
# its header lines <url>, <talkid>, ...; in the test XML files at <doc docid>); the cleaned pairs
# are split by talk (the 1st, 24th, 47th ... talk to valid, the others to train); each split's
# sentences are encoded with the sentence-level spm.model and scripts/make_documents.py joins them
# with " <sep> " (so <sep> stays one token), a talk longer than DOC_MAX_SENTENCES (64) cut into
# windows of DOC_MIN_SENTENCES (4) to 64 sentences whose sizes are drawn with DOC_SEED (1). Output:
# $WORK/data-bin-docs (<sep> is a word of both dictionaries), the detokenised documents
# $WORK/text-docs/{train,valid,test}.{de,en} and their tables $WORK/text-docs/*.docs.tsv (per
# document: sentences, input line range, talk).
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

# ---------------------------------------------------------------- documents (DOCS=1)
DOCS=${DOCS:-0}
DOC_TEXT=$WORK/text-docs DOC_SPM=$WORK/spm-docs DATA_BIN_DOCS=$WORK/data-bin-docs
DOC_ARGS=(--min-sentences "${DOC_MIN_SENTENCES:-4}" --max-sentences "${DOC_MAX_SENTENCES:-64}"
          --seed "${DOC_SEED:-1}" --separator "<sep>")
HEADER='^[ \t]*<(url|keywords|speaker|talkid|title|description|reviewer|translator)[ >]'

# The document id of every line that extract keeps (train.tags: the talk's number, counted at the
# first header line after text; test: SET.DOCID), then of the pairs that split_sets keeps
# (clean_pair's rule again, on three columns, checked against its output).
doc_ids() {
  local orig=$RAW_DIR/de-en set
  mkdir -p "$DOC_TEXT/sent" "$DOC_SPM/sent"
  awk -v header="$HEADER" '$0 ~ header { if (!in_header) talk++; in_header = 1; }
      $0 !~ header { in_header = 0 }
      index($0, "<url>") == 0 && index($0, "<talkid>") == 0 && index($0, "<keywords>") == 0 { print talk + 0 }' \
    "$orig/train.tags.de-en.$SRC" > "$DOC_TEXT/sent/train.tags.ids"
  for set in "${TEST_SETS[@]}"; do
    awk -v set="$set" 'match($0, /<doc docid="[^"]*"/) { doc = substr($0, RSTART + 12, RLENGTH - 13) }
      index($0, "<seg id") { print set "." doc }' "$orig/IWSLT14.$set.de-en.$SRC.xml"
  done > "$DOC_TEXT/sent/test.ids"
  paste -d '\t' "$DOC_TEXT/sent/train.tags.ids" <(tr '\t' ' ' < "$TEXT/train.tags.$SRC") <(tr '\t' ' ' < "$TEXT/train.tags.$TGT") |
    awk -F '\t' '{ ns = split($2, a, " "); nt = split($3, b, " ")
      if (ns >= 1 && nt >= 1 && ns <= 175 && nt <= 175 && ns <= 1.5 * nt && nt <= 1.5 * ns) print }' > "$DOC_TEXT/sent/clean.tsv"
  cut -f2 "$DOC_TEXT/sent/clean.tsv" | cmp -s - "$TEXT/clean.$SRC" ||
    die "the talk ids do not follow the cleaned pairs $TEXT/clean.$SRC (has split_sets' length filter changed?)"
  cut -f1 "$DOC_TEXT/sent/clean.tsv" > "$DOC_TEXT/sent/all.ids"
  rm "$DOC_TEXT/sent/clean.tsv"
  [ "$(wc -l < "$DOC_TEXT/sent/test.ids")" = "$(wc -l < "$TEXT/test.$SRC")" ] || die "test ids and $TEXT/test.$SRC differ in length"
  log "  $(uniq "$DOC_TEXT/sent/all.ids" | wc -l) talks in train+valid, $(uniq "$DOC_TEXT/sent/test.ids" | wc -l) in test"
}

# talk_split SPLIT FILE: the lines of FILE (parallel to the cleaned pairs) whose talk goes to SPLIT.
talk_split() {
  paste -d '\t' <(awk '{ print ($1 % 23 == 1) ? "valid" : "train" }' "$DOC_TEXT/sent/all.ids") "$2" |
    awk -F '\t' -v s="$1" '$1 == s' | cut -f2-
}

# The sentences of each document split, as text ($DOC_TEXT/sent) and encoded ($DOC_SPM/sent), with their ids.
doc_sentences() {
  local split l
  spm_encode "$WORK/spm.model" "$TEXT/all.$SRC" "$DOC_SPM/sent/all.$SRC" "$TEXT/all.$TGT" "$DOC_SPM/sent/all.$TGT"
  for split in train valid; do
    talk_split $split "$DOC_TEXT/sent/all.ids" > "$DOC_TEXT/sent/$split.ids"
    for l in $SRC $TGT; do
      talk_split $split "$TEXT/all.$l" > "$DOC_TEXT/sent/$split.$l"
      talk_split $split "$DOC_SPM/sent/all.$l" > "$DOC_SPM/sent/$split.$l"
    done
  done
  for l in $SRC $TGT; do
    cp "$TEXT/test.$l" "$DOC_TEXT/sent/test.$l"
    cp "$WORK/spm/test.$l" "$DOC_SPM/sent/test.$l"
  done
  count_lines "$DOC_TEXT"/sent/{train,valid,test}.ids
}

# The documents (scripts/make_documents.py): the same ids and seed group the text and the encoded
# sentences alike, which the tables confirm.
make_docs() {
  local split dir
  for split in train valid test; do
    for dir in "$DOC_TEXT" "$DOC_SPM"; do
      python "$ROOT/scripts/make_documents.py" "$dir/sent/$split.$SRC" "$dir/sent/$split.$TGT" "$dir/$split" \
        --doc-ids "$DOC_TEXT/sent/$split.ids" "${DOC_ARGS[@]}"
    done
    cmp -s <(cut -f1-4,7 "$DOC_TEXT/$split.docs.tsv") <(cut -f1-4,7 "$DOC_SPM/$split.docs.tsv") ||
      die "$split: the text and the encoded documents are grouped differently"
  done
}

binarize_docs() {
  rm -rf "$DATA_BIN_DOCS"
  fairseq-preprocess --source-lang $SRC --target-lang $TGT \
    --trainpref "$DOC_SPM/train" --validpref "$DOC_SPM/valid" --testpref "$DOC_SPM/test" \
    --destdir "$DATA_BIN_DOCS" --workers "${WORKERS:-$(nproc)}" 2>&1 | tee "$WORK/logs/preprocess-docs.log"
  cp "$WORK/spm.model" "$DATA_BIN_DOCS/"
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
if [ "$DOCS" = 1 ]; then
  step docs-ids doc_ids
  step docs-sentences doc_sentences
  step docs-make make_docs
  step docs-binarize binarize_docs
  log "prepared documents: $DATA_BIN_DOCS (text and tables: $DOC_TEXT)"
fi
