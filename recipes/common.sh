# Shared shell functions of the recipes (sourced, not run). Each recipe script does
#
#   . "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
#   recipe_init <task>
#
# and then runs its steps with `step NAME command...`: a step that finished writes a marker
# under $WORK/.done/ and is skipped on the next run, so an interrupted recipe resumes at the
# step that stopped (fairseq-train itself resumes from checkpoint_last.pt). Delete a marker (or
# the whole $WORK/.done) to redo a step.
#
# Environment read here (all optional):
#   WORK                 work folder of the task (default work/recipes/<task>, smoke: work/recipes-smoke/<task>)
#   SMOKE=1              tiny offline run on data made from data/multi30k (see recipes/README.md)
#   RFA_USE_CURRENT_ENV=1  use the active Python environment instead of .venv (as scripts/quickstart.sh)
#   RFA_VENV             the virtual environment to activate (default .venv in the repository)
set -euo pipefail

RECIPES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$RECIPES")
USER_DIR=$ROOT/rfa_fairseq
SMOKE=${SMOKE:-0}
MULTI30K=$ROOT/data/multi30k

log() { printf '[%s] [%s] %s\n' "$(date '+%Y-%m-%d %H:%M:%S')" "${TASK:-recipes}" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# recipe_init TASK: work folders, Python environment, quiet warnings; smoke mode keeps torch to
# one thread (tiny models on a shared CPU are ~100x slower with several competing threads).
recipe_init() {
  TASK=$1
  if [ "$SMOKE" = 1 ]; then
    WORK=${WORK:-$ROOT/work/recipes-smoke/$TASK}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  else
    WORK=${WORK:-$ROOT/work/recipes/$TASK}
  fi
  mkdir -p "$WORK/logs"
  WORK=$(cd "$WORK" && pwd)
  DONE_DIR=$WORK/.done
  DATA_BIN=$WORK/data-bin
  export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
  activate_env
  [ "$SMOKE" = 1 ] && log "smoke mode: tiny data and model, CPU, work folder $WORK"
  return 0
}

# The Python environment, as scripts/quickstart.sh: .venv (set up on first use) unless
# RFA_USE_CURRENT_ENV=1. setup_env.sh only runs when the fairseq tools are missing.
activate_env() {
  if [ "${RFA_USE_CURRENT_ENV:-0}" = 1 ]; then
    command -v fairseq-train >/dev/null || bash "$ROOT/scripts/setup_env.sh"
    return 0
  fi
  local venv=${RFA_VENV:-$ROOT/.venv}
  [ -x "$venv/bin/fairseq-train" ] || bash "$ROOT/scripts/setup_env.sh"
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
}

# step NAME command...: run the command unless $WORK/.done/NAME exists; write it on success.
step() {
  # Unusual local names: bash locals are visible to (and can be overwritten by) the functions called.
  local _step=$1; shift
  local _marker=$DONE_DIR/$_step _t0=$SECONDS
  if [ -e "$_marker" ]; then
    log "step $_step: already done ($(cat "$_marker")), skipping"
    return 0
  fi
  log "step $_step: start"
  "$@"
  mkdir -p "$DONE_DIR"
  echo "finished $(date '+%Y-%m-%d %H:%M:%S'), took $((SECONDS - _t0)) s" > "$_marker"
  log "step $_step: done in $((SECONDS - _t0)) s"
}

# set_variant VARIANT SOFTMAX_ARCH RFA_ARCH [--rfa-* flags]: the variant switch. Sets VARIANT,
# ARCH and RFA_ARGS (an array: the given --rfa-* flags, plus --rfa-gate for rfa_gate; empty for
# softmax, which runs fairseq's own architecture with the same command otherwise).
set_variant() {
  VARIANT=${1:-}
  case $VARIANT in
    softmax) ARCH=$2; RFA_ARGS=() ;;
    rfa) ARCH=$3; RFA_ARGS=("${@:4}") ;;
    rfa_gate) ARCH=$3; RFA_ARGS=("${@:4}" --rfa-gate) ;;
    *) die "first argument: the variant, one of softmax, rfa, rfa_gate (got '${VARIANT}')" ;;
  esac
  CKPT_DIR=$WORK/checkpoints/$VARIANT
  log "variant $VARIANT: --arch $ARCH ${RFA_ARGS[*]:-}"
}

# ---------------------------------------------------------------- downloads and raw data

# fetch ARCHIVE CHECK URL...: make $RAW_DIR/CHECK exist. If it already does (an extracted copy
# given with RAW_DIR), nothing happens; else ARCHIVE is unpacked into $RAW_DIR, after being
# downloaded from the first URL that answers if it is not there yet (wget -c resumes a partial
# download). CHECK.gz counts as CHECK (see cat_text).
fetch() {
  local archive=$1 check=$2; shift 2
  if [ -e "$RAW_DIR/$check" ] || [ -e "$RAW_DIR/$check.gz" ]; then
    log "found $RAW_DIR/$check, no download"
    return 0
  fi
  mkdir -p "$RAW_DIR"
  if [ ! -f "$RAW_DIR/$archive" ]; then
    local url ok=0 progress=dot:giga
    [ -t 2 ] && progress=bar:force:noscroll
    for url in "$@"; do
      log "downloading $url"
      if wget -c --tries=3 --timeout=60 --progress="$progress" -O "$RAW_DIR/$archive.part" "$url"; then
        mv "$RAW_DIR/$archive.part" "$RAW_DIR/$archive"; ok=1; break
      fi
      [ -s "$RAW_DIR/$archive.part" ] || rm -f "$RAW_DIR/$archive.part"
      log "download from $url failed"
    done
    [ "$ok" = 1 ] || die "could not download $archive (offline?). Download it from one of: $* into $RAW_DIR (or give an extracted copy with RAW_DIR=...) and run again."
  fi
  unpack "$RAW_DIR/$archive" "$RAW_DIR"
  [ -e "$RAW_DIR/$check" ] || die "$archive did not contain $check"
}

unpack() {
  local archive=$1 dest=$2
  log "unpacking $(basename "$archive") ($(du -h "$archive" | cut -f1))"
  case $archive in
    *.tgz|*.tar.gz) tar -xzf "$archive" -C "$dest" ;;
    *.tar) tar -xf "$archive" -C "$dest" ;;
    *.zip) if command -v unzip >/dev/null; then unzip -q -o "$archive" -d "$dest"; else python -m zipfile -e "$archive" "$dest"; fi ;;
    *) die "do not know how to unpack $archive" ;;
  esac
}

# cat_text FILE: print FILE, or FILE.gz decompressed when only that exists.
cat_text() {
  if [ -f "$1" ]; then cat "$1"; elif [ -f "$1.gz" ]; then gzip -dc "$1.gz"; else die "missing $1"; fi
}

# sgm_text FILE: the segments of a WMT .sgm file, one per line (text as is: the references then
# equal sacreBLEU's own wmt14/full test sets).
sgm_text() {
  grep '<seg id' "$1" | sed -e 's/<seg id="[0-9]*">\s*//' -e 's/\s*<\/seg>\s*$//'
}

# smoke_lines SPLIT LANG SKIP N: lines SKIP+1..SKIP+N of data/multi30k/SPLIT.LANG.gz (the
# shipped Multi30k sample that smoke mode builds its stand-in raw data from).
smoke_lines() {
  gzip -dc "$MULTI30K/$1.$2.gz" | awk -v s="$3" -v n="$4" 'NR > s && NR <= s + n'
}

# strip_controls: ASCII control characters other than tab and newline become spaces (as Moses'
# remove-non-printing-char.perl, for the same reason: a stray carriage return would split a line
# in Python's universal-newline reading and misalign the two sides of a parallel corpus).
strip_controls() { LC_ALL=C tr '\000-\010\013-\037\177' ' '; }

lowercase() { python -c 'import sys
for line in sys.stdin: sys.stdout.write(line.lower())'; }

count_lines() {
  local f
  for f in "$@"; do log "  $(wc -l < "$f") lines  $f"; done
}

# clean_pair SRC TGT OUT_SRC OUT_TGT MIN MAX RATIO: keep the sentence pairs whose two sides have
# MIN..MAX whitespace-separated tokens and a length ratio of at most RATIO either way (the rules
# of Moses' clean-corpus-n.perl, which fairseq's prepare scripts use).
clean_pair() {
  local src=$1 tgt=$2 out_src=$3 out_tgt=$4 min=$5 max=$6 ratio=$7
  paste -d '\t' <(tr '\t' ' ' < "$src") <(tr '\t' ' ' < "$tgt") |
    awk -F '\t' -v min="$min" -v max="$max" -v ratio="$ratio" '
      { ns = split($1, a, " "); nt = split($2, b, " ")
        if (ns >= min && nt >= min && ns <= max && nt <= max && ns <= ratio * nt && nt <= ratio * ns) print }' \
    > "$out_src.pairs"
  cut -f1 "$out_src.pairs" > "$out_src"
  cut -f2 "$out_src.pairs" > "$out_tgt"
  rm "$out_src.pairs"
  log "  kept $(wc -l < "$out_src") of $(wc -l < "$src") pairs (length $min..$max, ratio <= $ratio)"
}

# spm_train PREFIX VOCAB FILES...: joint sentencepiece model on FILES (scripts/sentencepiece_tool.py),
# with the extra flags in the array SPM_ARGS.
SPM_ARGS=()
spm_train() {
  local prefix=$1 vocab=$2; shift 2
  log "training a joint sentencepiece model ($vocab pieces) on $(cat "$@" | wc -l) lines; this takes minutes on the full data"
  python "$ROOT/scripts/sentencepiece_tool.py" train --model-prefix "$prefix" --vocab-size "$vocab" \
    "${SPM_ARGS[@]}" "$@"
}

# spm_encode MODEL IN OUT [IN OUT...]: one process per pair, in parallel.
spm_encode() {
  local model=$1; shift
  local pids=()
  while [ $# -gt 0 ]; do
    log "  encoding $1 ($(wc -l < "$1") lines) -> $2"
    python "$ROOT/scripts/sentencepiece_tool.py" encode --model "$model" "$1" "$2" &
    pids+=($!)
    shift 2
  done
  local pid
  for pid in "${pids[@]}"; do wait "$pid"; done
}

# ---------------------------------------------------------------- training and evaluation

# The number of GPUs training will use: WORLD_SIZE if set (give it for multi-node runs), else the
# visible GPUs (CUDA_VISIBLE_DEVICES or nvidia-smi), else 1.
world_size() {
  if [ -n "${WORLD_SIZE:-}" ]; then echo "$WORLD_SIZE"
  elif [ "$SMOKE" = 1 ]; then echo 1
  elif [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    local n; n=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c . || true); echo $((n > 0 ? n : 1))
  elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then nvidia-smi -L | grep -c '^GPU'
  else echo 1; fi
}

has_gpu() { [ "$SMOKE" != 1 ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }

# set_batch REF_GPU_BATCHES MAX_TOKENS: UPDATE_FREQ (unless given) such that one update sees about
# REF_GPU_BATCHES batches of MAX_TOKENS tokens whatever the number of GPUs (the reference setups
# were trained on 8 GPUs); FP16_ARGS is --fp16 on a GPU (FP16=0 to switch off).
set_batch() {
  local ref=$1 max_tokens=$2 world
  world=$(world_size)
  UPDATE_FREQ=${UPDATE_FREQ:-$(( (ref + world / 2) / world > 0 ? (ref + world / 2) / world : 1 ))}
  FP16_ARGS=()
  if [ "${FP16:-1}" = 1 ] && has_gpu; then FP16_ARGS=(--fp16); fi
  log "batch: $world GPU(s) x --max-tokens $max_tokens x --update-freq $UPDATE_FREQ = $((world * max_tokens * UPDATE_FREQ)) tokens per update ${FP16_ARGS[*]:-}"
}

# train_cmd ARGS...: fairseq-train, or it under a launcher such as torchrun (LAUNCHER="torchrun
# --nnodes 2 --nproc-per-node 8 ..."); output goes to the terminal and to $WORK/logs/ (pipefail
# keeps fairseq-train's exit status, which decides whether the step counts as done).
train_cmd() {
  local log_file=$WORK/logs/train.$VARIANT.log
  log "fairseq-train log: $log_file"
  if [ -n "${LAUNCHER:-}" ]; then
    # shellcheck disable=SC2086
    $LAUNCHER "$(command -v fairseq-train)" "$@" 2>&1 | tee -a "$log_file"
  else
    fairseq-train "$@" 2>&1 | tee -a "$log_file"
  fi
}

# newest_update DIR: the update count of the newest checkpoint_E_U.pt in DIR.
newest_update() {
  find "$1" -maxdepth 1 -name 'checkpoint_*_*.pt' 2>/dev/null |
    sed -E 's/.*checkpoint_[0-9]+_([0-9]+)\.pt$/\1/' | sort -n | tail -n 1
}

# average_last N OUT: average the last N update checkpoints of $CKPT_DIR (scripts/average_checkpoints.py).
average_last() {
  local n=$1 out=$2 have
  have=$(find "$CKPT_DIR" -maxdepth 1 -name 'checkpoint_*_*.pt' | wc -l)
  [ "$have" -ge "$n" ] || die "$CKPT_DIR has $have update checkpoints, averaging needs $n (train longer, or NUM_AVG=$have)"
  mkdir -p "$(dirname "$out")"
  python "$ROOT/scripts/average_checkpoints.py" --inputs "$CKPT_DIR" --num-update-checkpoints "$n" --output "$out"
}

# fairseq (main, and so fairseq-fixed) drops the last batch when its size is not a multiple of
# --required-batch-size-multiple (default 8; facebookresearch/fairseq#5036): evaluation passes
# --required-batch-size-multiple 1 so that every test sentence (LM block) is scored.

# evaluate_translation [extra fairseq-generate flags]: the translation recipes' evaluation.
# Reads SRC, TGT, LENPEN, TEST_NAME, SCORE_ARGS (flags of tools/score_bleu.py) and VARIANT.
# Averages the last NUM_AVG (default 10) update checkpoints, decodes the test set with beam 4,
# turns the sentencepiece output back into text (--post-process sentencepiece) and scores it
# against the detokenised references $WORK/text/test.$TGT. Each result is tied to the newest
# checkpoint, so training further and evaluating again redoes all three steps.
evaluate_translation() {
  local num_avg=${NUM_AVG:-10} last tag
  last=$(newest_update "$CKPT_DIR")
  [ -n "$last" ] || die "no update checkpoints in $CKPT_DIR: run train.sh $VARIANT first"
  tag=u$last.avg$num_avg
  EVAL_DIR=$WORK/eval/$VARIANT
  AVG=$EVAL_DIR/checkpoint.$tag.pt
  GEN_DIR=$EVAL_DIR/generate.$tag
  HYP=$EVAL_DIR/test.$tag.hyp.$TGT
  RESULTS=$EVAL_DIR/bleu.$tag.txt
  mkdir -p "$EVAL_DIR"
  step "average.$VARIANT.$tag" average_last "$num_avg" "$AVG"
  step "generate.$VARIANT.$tag" generate_test "$@"
  step "score.$VARIANT.$tag" score_test
  log "results ($RESULTS):"
  cat "$RESULTS"
}

generate_test() {
  rm -rf "$GEN_DIR"
  fairseq-generate "$DATA_BIN" --user-dir "$USER_DIR" --task translation \
    --source-lang "$SRC" --target-lang "$TGT" --gen-subset test --path "$AVG" \
    --beam 4 --lenpen "$LENPEN" --max-tokens "${GEN_MAX_TOKENS:-8000}" --required-batch-size-multiple 1 \
    --post-process sentencepiece --results-path "$GEN_DIR" "$@" 2>&1 | tee "$WORK/logs/generate.$VARIANT.log"
  grep '^H-' "$GEN_DIR/generate-test.txt" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$HYP"
  log "$(grep -o 'Translated .*' "$WORK/logs/generate.$VARIANT.log" | tail -n 1)"
}

score_test() {
  python "$RECIPES/tools/score_bleu.py" --hyp "$HYP" --ref "$WORK/text/test.$TGT" --name "$TEST_NAME" \
    "${SCORE_ARGS[@]}" > "$RESULTS"
}
