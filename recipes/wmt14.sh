# The WMT14 data preparation shared by wmt14_en_de/prepare.sh and wmt14_en_fr/prepare.sh (sourced
# after common.sh). The calling script sets:
#   SRC, TGT          languages (en and de / fr)
#   VOCAB             size of the joint sentencepiece model
#   CORPORA           training corpora, paths under RAW_DIR without the .LANG suffix
#   DEV               the validation set (newstest2013), path under RAW_DIR without .LANG
#   TEST_SRC_SGM, TEST_REF_SGM   newstest2014 source and reference (.sgm) under RAW_DIR
#   ARCHIVES          entries "ARCHIVE FILE_IT_CONTAINS URL [URL...]" (see fetch in common.sh)
#
# The pipeline follows fairseq's examples/translation/prepare-wmt14en2{de,fr}.sh (as Vaswani et
# al. 2017 and Ott et al. 2018): the training corpora concatenated; a joint subword model learned
# on them; training pairs of 1-250 subwords with a length ratio <= 1.5 kept (Moses'
# clean-corpus-n rules, applied after segmentation as fairseq does). Differences: sentencepiece
# on raw text instead of Moses normalisation/tokenisation + BPE; ASCII control characters are
# blanked (remove-non-printing-char's role); the validation set is newstest2013 (as Vaswani et
# al.) rather than a slice of the training data; the test references stay exactly as in the
# .sgm files (sacreBLEU's wmt14/full).

TEXT=$WORK/text

fetch_all() {
  local entry
  for entry in "${ARCHIVES[@]}"; do
    # shellcheck disable=SC2086
    fetch $entry
  done
}

extract() {
  mkdir -p "$TEXT"
  local l c
  for l in $SRC $TGT; do
    : > "$TEXT/train.raw.$l"
    for c in "${CORPORA[@]}"; do
      log "  $c.$l: $(cat_text "$RAW_DIR/$c.$l" | strip_controls | tee -a "$TEXT/train.raw.$l" | wc -l) lines"
    done
    cat_text "$RAW_DIR/$DEV.$l" | strip_controls > "$TEXT/valid.$l"
  done
  [ "$(wc -l < "$TEXT/train.raw.$SRC")" = "$(wc -l < "$TEXT/train.raw.$TGT")" ] ||
    die "the training corpora have different line counts in $SRC and $TGT"
  sgm_text "$RAW_DIR/$TEST_SRC_SGM" > "$TEXT/test.$SRC"
  sgm_text "$RAW_DIR/$TEST_REF_SGM" > "$TEXT/test.$TGT"
  count_lines "$TEXT"/{train.raw,valid,test}."$SRC" "$TEXT"/{train.raw,valid,test}."$TGT"
}

encode() {
  mkdir -p "$WORK/spm"
  local args=() split l
  for split in train.raw valid test; do
    for l in $SRC $TGT; do args+=("$TEXT/$split.$l" "$WORK/spm/$split.$l"); done
  done
  spm_encode "$WORK/spm.model" "${args[@]}"
}

clean_train() {
  clean_pair "$WORK/spm/train.raw.$SRC" "$WORK/spm/train.raw.$TGT" "$WORK/spm/train.$SRC" "$WORK/spm/train.$TGT" 1 250 1.5
}

binarize() {
  rm -rf "$DATA_BIN"
  fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" --joined-dictionary \
    --trainpref "$WORK/spm/train" --validpref "$WORK/spm/valid" --testpref "$WORK/spm/test" \
    --destdir "$DATA_BIN" --workers "${WORKERS:-$(nproc)}" 2>&1 | tee "$WORK/logs/preprocess.log"
  cp "$WORK/spm.model" "$DATA_BIN/"
}

# Smoke mode: the archives of ARCHIVES, made from Multi30k with the real archives' layout and
# file names (the English side as $SRC, the German side as $TGT: for en-fr a stand-in for
# French), so that fetch unpacks them exactly as it unpacks the downloads. Consecutive slices of
# the Multi30k training set make the corpora; giga-fren's files are gzipped inside its .tar, as
# in the real one. Each archive holds the files next to the one its ARCHIVES entry names, whose
# names start alike (training/europarl*, dev/newstest2013*, test-full/newstest2014*, ...).
make_smoke_raw() {
  local stage=$RAW_DIR/stage c offset=0 n=150 tgt_side=de entry archive check prefix files
  rm -rf "$stage"
  for c in "${CORPORA[@]}"; do
    mkdir -p "$stage/$(dirname "$c")"
    smoke_lines train en $offset $n > "$stage/$c.$SRC"
    smoke_lines train $tgt_side $offset $n > "$stage/$c.$TGT"
    case $c in giga-fren*) gzip -f "$stage/$c.$SRC" "$stage/$c.$TGT" ;; esac
    offset=$((offset + n)); n=100
  done
  mkdir -p "$stage/$(dirname "$DEV")" "$stage/$(dirname "$TEST_SRC_SGM")"
  smoke_lines valid en 0 30 > "$stage/$DEV.$SRC"
  smoke_lines valid $tgt_side 0 30 > "$stage/$DEV.$TGT"
  smoke_sgm en src "$stage/$TEST_SRC_SGM"
  smoke_sgm $tgt_side ref "$stage/$TEST_REF_SGM"
  for entry in "${ARCHIVES[@]}"; do
    read -r archive check _ <<< "$entry"
    prefix=$(dirname "$check")/$(basename "$check" | sed 's/[.-].*//')
    prefix=${prefix#./}
    files=$(cd "$stage" && ls -d "$prefix"*)
    # shellcheck disable=SC2086
    case $archive in
      *.tgz) tar -czf "$RAW_DIR/$archive" -C "$stage" $files ;;
      *.tar) tar -cf "$RAW_DIR/$archive" -C "$stage" $files ;;
      *) die "smoke mode cannot make $archive" ;;
    esac
  done
  rm -r "$stage"
}

smoke_sgm() {
  smoke_lines test "$1" 0 12 | awk -v kind="$2" 'BEGIN {
      print "<" kind "set setid=\"newstest2014\" srclang=\"any\">"; print "<doc sysid=\"" kind "\" docid=\"smoke\" origlang=\"en\">" }
    { print "<seg id=\"" NR "\">" $0 "</seg>" }
    END { print "</doc>"; print "</" kind "set>" }' > "$3"
}

wmt14_prepare() {
  if [ "$SMOKE" = 1 ]; then
    RAW_DIR=$WORK/orig-smoke VOCAB=${SMOKE_VOCAB:-1000}
    [ "$TGT" = de ] || log "smoke data: Multi30k's German side stands in for '$TGT'"
    step smoke-raw make_smoke_raw
  fi
  log "raw data folder: $RAW_DIR"
  step fetch fetch_all
  step extract extract
  SPM_ARGS=(--character-coverage 0.9999)  # rare characters of the web-crawled corpora map to <unk>
  step spm spm_train "$WORK/spm" "$VOCAB" "$TEXT/train.raw.$SRC" "$TEXT/train.raw.$TGT"
  step encode encode
  step clean clean_train
  step binarize binarize
  log "prepared: $DATA_BIN"
}
