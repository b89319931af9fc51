#!/usr/bin/env bash
# Long Range Arena text tasks: data for fairseq's sentence_prediction task.
#
#   bash recipes/lra/prepare.sh listops                  # generates ListOps with the LRA settings (listops.py)
#   RAW_DIR=/data/lra_release/listops-1000 bash recipes/lra/prepare.sh listops   # the official files instead
#   bash recipes/lra/prepare.sh text                     # downloads aclImdb_v1.tar.gz (Stanford), byte-level IMDb
#   RAW_DIR=/data/lra_release/tsv_data bash recipes/lra/prepare.sh retrieval     # the AAN pairs of the LRA release
#   SMOKE=1 bash recipes/lra/prepare.sh TASK             # tiny synthetic files in the official layout, offline
#
# Steps: the raw files (generated, downloaded or given), prepare.py (the symbols each example is
# made of, the labels, the fixed dictionaries: 15 ListOps symbols, 256 bytes), then
# fairseq-preprocess per field with those dictionaries. Output: $WORK/data-bin/{input0,label}/
# (and input1/ for retrieval, the second document), the folders sentence_prediction reads.
# RAW_DIR for retrieval: new_aan_pairs.{train,eval,test}.tsv, in lra_release/tsv_data of
# https://storage.googleapis.com/long-range-arena/lra_release.gz (not downloaded here: a large
# archive). MAX_LENGTH: bytes kept per document for text and retrieval (default 4000).
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
. "$RECIPES/lra/settings.sh"
lra_init "${1:-}"
LRA=$RECIPES/lra
TEXT=$WORK/text
MAX_LENGTH=${MAX_LENGTH:-4000}
IMDB_URL=https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz
FIELDS=(input0 label)
[ "$TASK_NAME" = retrieval ] && FIELDS=(input0 input1 label)

# Smoke mode: tiny synthetic files in the official layout; for text, packed into the archive that
# the download would bring, so that the unpacking below runs as it does on the real data.
make_smoke_raw() {
  python "$LRA/prepare.py" smoke-raw "$TASK_NAME" --raw "$RAW_DIR"
  if [ "$TASK_NAME" = text ]; then
    tar -czf "$RAW_DIR/aclImdb_v1.tar.gz" -C "$RAW_DIR" aclImdb
    rm -r "$RAW_DIR/aclImdb"
  fi
}

raw_files() {
  case $TASK_NAME in
    listops)
      if [ -f "$RAW_DIR/basic_train.tsv" ]; then
        log "found $RAW_DIR/basic_train.tsv: using the ListOps files there"
      else
        log "generating ListOps with the LRA settings into $RAW_DIR (96,000 / 2,000 / 2,000 expressions; minutes)"
        python "$LRA/listops.py" --out-dir "$RAW_DIR" --seed "${DATA_SEED:-1}"
      fi ;;
    text) fetch aclImdb_v1.tar.gz aclImdb/train/pos "$IMDB_URL" ;;
    retrieval)
      [ -f "$RAW_DIR/new_aan_pairs.train.tsv" ] ||
        die "no $RAW_DIR/new_aan_pairs.train.tsv: give RAW_DIR=<lra_release>/tsv_data (from https://storage.googleapis.com/long-range-arena/lra_release.gz)" ;;
  esac
}

convert() {
  local args=()
  [ "$TASK_NAME" = listops ] || args=(--max-length "$MAX_LENGTH")
  python "$LRA/prepare.py" "$TASK_NAME" --raw "$RAW_DIR" --out "$TEXT" ${args[@]+"${args[@]}"}
  count_lines "$TEXT"/*.label
}

binarize() {
  local field dict
  rm -rf "$DATA_BIN"
  for field in ${FIELDS[@]+"${FIELDS[@]}"}; do
    dict=$TEXT/dict.input0.txt
    [ "$field" = label ] && dict=$TEXT/dict.label.txt
    fairseq-preprocess --only-source --srcdict "$dict" --trainpref "$TEXT/train.$field" \
      --validpref "$TEXT/valid.$field" --testpref "$TEXT/test.$field" --destdir "$DATA_BIN/$field" \
      --workers "${WORKERS:-$(nproc)}" 2>&1 | tee -a "$WORK/logs/preprocess.log"
  done
}

if [ "$SMOKE" = 1 ]; then
  RAW_DIR=$WORK/orig-smoke
  step smoke-raw make_smoke_raw
else
  RAW_DIR=${RAW_DIR:-$WORK/orig}
fi
log "raw data folder: $RAW_DIR"
step raw raw_files
step convert convert
step binarize binarize
log "prepared: $DATA_BIN"
