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
#
# Arrays that may be empty are expanded as ${A[@]+"${A[@]}"}: bash before 4.4 treats "${A[@]}" of
# an empty array as an unbound variable under set -u.
set -euo pipefail

RECIPES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$RECIPES")
USER_DIR=$ROOT/rfa_fairseq
SMOKE=${SMOKE:-0}
SEED=${SEED:-1}
SIZE_ARGS=()
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

# The variants every recipe offers: fairseq's softmax model, and the RFA model with the flags below
# (added to the task's --rfa-* flags). rfa and rfa_gate use the plugin's defaults for everything
# else; rfa_gate_paper pins the gate of the paper (convex form, bias 0) whatever those defaults
# become; the others are the paper's ablations (arc-cosine kernel, phi_elu of Katharopoulos et
# al.) and Performer's positive features.
VARIANTS="softmax rfa rfa_gate rfa_gate_paper rfa_arccos rfa_gate_arccos rfa_elu rfa_favor"
variant_flags() {
  case $1 in
    rfa) ;;
    rfa_gate) echo --rfa-gate ;;
    rfa_gate_paper) echo --rfa-gate --rfa-gate-form convex --rfa-gate-bias 0 ;;
    rfa_arccos) echo --rfa-kernel arccos ;;
    rfa_gate_arccos) echo --rfa-kernel arccos --rfa-gate ;;
    rfa_elu) echo --rfa-kernel elu ;;
    rfa_favor) echo --rfa-kernel favor ;;
    *) return 1 ;;
  esac
}

# select_size DEFAULT [OTHER...]: SIZE (from the environment, else DEFAULT), checked against the
# sizes the task offers. SIZE_SUFFIX is empty for the default size and ".SIZE" otherwise: it ends
# the run name, so that the sizes of one variant never share checkpoints.
select_size() {
  local default=$1 s
  SIZE=${SIZE:-$default} SIZE_SUFFIX=
  for s in "$@"; do
    if [ "$s" = "$SIZE" ]; then
      [ "$SIZE" = "$default" ] || SIZE_SUFFIX=.$SIZE
      return 0
    fi
  done
  die "SIZE must be one of: $* for $TASK (got '$SIZE')"
}

# select_stateful VARIANT: STATEFUL=1 (language models, RFA variants) trains and scores with the
# recurrent state carried from block to block (--task rfa_stateful_lm; the paper's "stateful" rows);
# the run name gains ".stateful", so it never mixes with the run of the same variant without state.
select_stateful() {
  STATEFUL=${STATEFUL:-0}
  case $STATEFUL in
    0) ;;
    1) [ "${1:-}" != softmax ] || die "STATEFUL=1 needs an RFA variant: softmax attention has no recurrent state to carry"
       SIZE_SUFFIX=${SIZE_SUFFIX:-}.stateful ;;
    *) die "STATEFUL must be 0 or 1, got '$STATEFUL'" ;;
  esac
}

# set_variant VARIANT SOFTMAX_ARCH RFA_ARCH [--rfa-* flags of the task]: the variant switch. Sets
# VARIANT, ARCH, RFA_ARGS (an array: the task's flags plus the variant's; empty for softmax, which
# runs fairseq's own architecture with the same command otherwise), RUN (the run name: $RUN from
# the environment, else VARIANT plus the size suffix) and CKPT_DIR=$WORK/checkpoints/$RUN.
set_variant() {
  VARIANT=${1:-}
  local flags
  if [ "$VARIANT" = softmax ]; then
    ARCH=$2; RFA_ARGS=()
  elif flags=$(variant_flags "$VARIANT"); then
    ARCH=$3
    # shellcheck disable=SC2206
    RFA_ARGS=("${@:4}" $flags)
  else
    die "first argument: the variant, one of ${VARIANTS// /, } (got '${VARIANT}')"
  fi
  RUN=${RUN:-$VARIANT${SIZE_SUFFIX:-}}
  [[ $RUN =~ ^[A-Za-z0-9][A-Za-z0-9._+-]*$ ]] ||
    die "RUN (the run name) may hold letters, digits and . _ + - and must not start with a sign (got '$RUN')"
  CKPT_DIR=$WORK/checkpoints/$RUN
  log "variant $VARIANT, run $RUN: --arch $ARCH ${RFA_ARGS[*]:-}"
}

# ---------------------------------------------------------------- downloads and raw data

# fetch ARCHIVE CHECK URL...: make $RAW_DIR/CHECK (or CHECK.gz: see cat_text) exist. If it already
# does (an extracted copy given with RAW_DIR), nothing happens; else ARCHIVE is unpacked into
# $RAW_DIR, after being downloaded from the first URL that answers if it is not there yet (a
# partial download is continued).
fetch() {
  local archive=$1 check=$2; shift 2
  if has_text "$RAW_DIR/$check"; then
    log "found $RAW_DIR/$check, no download"
    return 0
  fi
  mkdir -p "$RAW_DIR"
  [ -f "$RAW_DIR/$archive" ] || download "$RAW_DIR/$archive" "$@"
  unpack "$RAW_DIR/$archive" "$RAW_DIR"
  has_text "$RAW_DIR/$check" || die "$archive did not contain $check (nor $check.gz)"
}

has_text() { [ -e "$1" ] || [ -e "$1.gz" ]; }

# download FILE URL...: FILE from the first URL that answers (wget, else curl; both resume).
download() {
  local file=$1 url progress=dot:giga; shift
  command -v wget >/dev/null || command -v curl >/dev/null ||
    die "neither wget nor curl is installed: install one (e.g. apt-get install wget), or download $(basename "$file") from one of: $* into $(dirname "$file") yourself"
  [ -t 2 ] && progress=bar:force:noscroll
  for url in "$@"; do
    log "downloading $url"
    if command -v wget >/dev/null; then
      wget -c --tries=3 --timeout=60 --progress="$progress" -O "$file.part" "$url" && { mv "$file.part" "$file"; return 0; }
    else
      curl -fL -C - --retry 3 --connect-timeout 60 -o "$file.part" "$url" && { mv "$file.part" "$file"; return 0; }
    fi
    [ -s "$file.part" ] || rm -f "$file.part"
    log "download from $url failed"
  done
  die "could not download $(basename "$file") from any of: $* (no network here?). Download it into $(dirname "$file") (or give an extracted copy with RAW_DIR=...) and run again."
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
    ${SPM_ARGS[@]+"${SPM_ARGS[@]}"} "$@"
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

# gpu_count: the GPUs torch sees (it honours CUDA_VISIBLE_DEVICES); 0 in smoke mode or without CUDA.
gpu_count() {
  if [ "$SMOKE" = 1 ]; then echo 0; return 0; fi
  if [ -z "${_GPU_COUNT:-}" ]; then
    _GPU_COUNT=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  fi
  echo "$_GPU_COUNT"
}

# world_size [train.sh's extra flags]: the number of GPUs training will use: WORLD_SIZE if set (give
# it for multi-node runs), else --distributed-world-size among the flags, else the GPUs torch
# sees, at least 1.
world_size() {
  local prev=
  if [ -n "${WORLD_SIZE:-}" ]; then echo "$WORLD_SIZE"; return 0; fi
  while [ $# -gt 0 ]; do
    case $1 in
      --distributed-world-size=*) echo "${1#*=}"; return 0 ;;
    esac
    if [ "$prev" = --distributed-world-size ]; then echo "$1"; return 0; fi
    prev=$1; shift
  done
  local n; n=$(gpu_count)
  echo $((n > 0 ? n : 1))
}

# set_batch REF_BATCHES GPU_TOKENS UNIT [train.sh's extra flags]: MAX_TOKENS and UPDATE_FREQ such
# that every update sees the reference batch (REF_BATCHES GPU batches of GPU_TOKENS tokens, the
# setup the learning rate and the number of updates come from) whatever the number of GPUs; a
# warning when that cannot be kept (tools/batch_plan.py). MAX_TOKENS or UPDATE_FREQ from the
# environment are kept as given. FP16_ARGS is --fp16 on a GPU (FP16=0 to switch it off).
set_batch() {
  local ref=$1 gpu_tokens=$2 unit=$3 world plan; shift 3
  world=$(world_size "$@")
  [[ $world =~ ^[1-9][0-9]*$ ]] || die "the number of GPUs must be a positive integer (WORLD_SIZE / --distributed-world-size), got '$world'"
  plan=$(python "$RECIPES/tools/batch_plan.py" --ref-batches "$ref" --gpu-tokens "$gpu_tokens" --unit "$unit" \
    --world "$world" ${MAX_TOKENS:+--max-tokens "$MAX_TOKENS"} ${UPDATE_FREQ:+--update-freq "$UPDATE_FREQ"}) ||
    die "no batch plan for MAX_TOKENS='${MAX_TOKENS:-}' UPDATE_FREQ='${UPDATE_FREQ:-}'"
  eval "$plan"
  FP16_ARGS=()
  if [ "${FP16:-1}" = 1 ] && [ "$(gpu_count)" -gt 0 ]; then FP16_ARGS=(--fp16); fi
  log "batch: $world GPU(s) x --max-tokens $MAX_TOKENS x --update-freq $UPDATE_FREQ = $BATCH_TOKENS tokens per update (reference $REF_TOKENS) ${FP16_ARGS[*]:-}"
  [ -z "$BATCH_WARNING" ] || log "WARNING: $BATCH_WARNING"
}

# train_cmd ARGS...: fairseq-train, or it under a launcher such as torchrun (LAUNCHER="torchrun
# --nnodes 2 --nproc-per-node 8 ..."); output goes to the terminal and to $WORK/logs/ (pipefail
# keeps fairseq-train's exit status, which decides whether the step counts as done).
train_cmd() {
  local log_file=$WORK/logs/train.$RUN.log
  log "fairseq-train log: $log_file"
  if [ -n "${LAUNCHER:-}" ]; then
    # shellcheck disable=SC2086
    $LAUNCHER "$(command -v fairseq-train)" "$@" 2>&1 | tee -a "$log_file"
  else
    fairseq-train "$@" 2>&1 | tee -a "$log_file"
  fi
}

# run_identity [train.sh's extra flags]: what makes a run that run: the architecture, the --rfa-*
# flags, the size's and the user's extra flags and the seed. Launch details (--distributed-*,
# which differ from node to node) and the batch and update count (which may change on resume)
# are left out.
run_identity() {
  local out=(--arch "$ARCH" ${RFA_ARGS[@]+"${RFA_ARGS[@]}"} ${SIZE_ARGS[@]+"${SIZE_ARGS[@]}"} --seed "$SEED")
  while [ $# -gt 0 ]; do
    case $1 in
      --distributed-*=*) shift ;;
      --distributed-*) shift; if [ $# -gt 0 ] && [[ $1 != --* ]]; then shift; fi ;;
      *) out+=("$1"); shift ;;
    esac
  done
  echo "${out[*]}"
}

# train_run [train.sh's extra flags]: the training step of train.sh, whose function `train` runs
# fairseq-train with the recipe's flags and then these. The run's identity (run_identity) is kept
# in $CKPT_DIR/recipe_run.txt: a command that would resume or skip a run started with other
# settings stops with an error instead. DRY_RUN=1 prints the fairseq-train command and stops.
train_run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    train_cmd() { printf '%q ' fairseq-train "$@"; echo; }
    train "$@"
    return 0
  fi
  local identity record=$CKPT_DIR/recipe_run.txt
  identity=$(run_identity "$@")
  if [ -f "$record" ] && [ "$(cat "$record")" != "$identity" ]; then
    die "run '$RUN' ($CKPT_DIR) was started with: $(cat "$record") -- this command asks for: $identity. Name this run differently (RUN=<name> bash $0 $VARIANT ...), or delete $record to continue '$RUN' with the new settings."
  fi
  mkdir -p "$CKPT_DIR"
  echo "$identity" > "$record"
  step "train.$RUN.u$MAX_UPDATE" train "$@"
  log "checkpoints: $CKPT_DIR"
}

# newest_update DIR: the update count of the newest checkpoint_E_U.pt in DIR.
newest_update() {
  # A missing folder is no error here (pipefail would otherwise end the caller without a message).
  { find "$1" -maxdepth 1 -name 'checkpoint_*_*.pt' 2>/dev/null || true; } |
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
# Reads SRC, TGT, LENPEN, TEST_NAME, SCORE_ARGS (flags of tools/score_bleu.py), VARIANT and RUN.
# Averages the last NUM_AVG (default 10) update checkpoints, decodes the test set with beam 4,
# turns the sentencepiece output back into text (--post-process sentencepiece) and scores it
# against the detokenised references $WORK/text/test.$TGT. Each result is tied to the newest
# checkpoint, so training further and evaluating again redoes all three steps.
evaluate_translation() {
  local num_avg=${NUM_AVG:-10} last tag
  last=$(newest_update "$CKPT_DIR")
  [ -n "$last" ] || die "no update checkpoints in $CKPT_DIR: run train.sh $VARIANT first (with the same RUN / SIZE)"
  tag=u$last.avg$num_avg
  EVAL_DIR=$WORK/eval/$RUN
  AVG=$EVAL_DIR/checkpoint.$tag.pt
  GEN_DIR=$EVAL_DIR/generate.$tag
  HYP=$EVAL_DIR/test.$tag.hyp.$TGT
  RESULTS=$EVAL_DIR/bleu.$tag.txt
  mkdir -p "$EVAL_DIR"
  step "average.$RUN.$tag" average_last "$num_avg" "$AVG"
  step "generate.$RUN.$tag" generate_test "$@"
  step "score.$RUN.$tag" score_test
  log "results ($RESULTS):"
  cat "$RESULTS"
}

# The decoding flags of evaluation (and of the speed table): beam 4, the task's length penalty.
generate_flags() {
  GENERATE_FLAGS=(--beam 4 --lenpen "$LENPEN" --max-tokens "${GEN_MAX_TOKENS:-8000}" --required-batch-size-multiple 1
                  --post-process sentencepiece)
}

generate_test() {
  rm -rf "$GEN_DIR"
  generate_flags
  fairseq-generate "$DATA_BIN" --user-dir "$USER_DIR" --task rfa_translation \
    --source-lang "$SRC" --target-lang "$TGT" --gen-subset test --path "$AVG" \
    "${GENERATE_FLAGS[@]}" --results-path "$GEN_DIR" "$@" 2>&1 | tee "$WORK/logs/generate.$RUN.log"
  grep '^H-' "$GEN_DIR/generate-test.txt" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$HYP"
  log "$(grep -o 'Translated .*' "$WORK/logs/generate.$RUN.log" | tail -n 1)"
}

score_test() {
  python "$RECIPES/tools/score_bleu.py" --hyp "$HYP" --ref "$WORK/text/test.$TGT" --name "$TEST_NAME" \
    --lang "$TGT" ${SCORE_ARGS[@]+"${SCORE_ARGS[@]}"} > "$RESULTS"
}

# speed_table [RUN...] [-- extra fairseq-generate flags]: decode the test set with each run's model
# (default: softmax, rfa, rfa_gate of the current SIZE; the first is the reference of the ratios)
# using evaluation's flags, and write the speed and memory table $WORK/eval/speed.md (and .json)
# with bench/decode.py checkpoint and bench/report.py. Each run's model is the newest averaged checkpoint evaluate.sh
# made, else its checkpoint_last.pt. Measured again on every call (timings are not cached).
speed_table() {
  local runs=() extra=() models=() run ckpt
  while [ $# -gt 0 ] && [ "$1" != -- ]; do runs+=("$1"); shift; done
  [ $# -gt 0 ] && shift && extra=("$@")
  # smoke models are untrained: cap their outputs (and stay on the CPU)
  if [ "$SMOKE" = 1 ]; then extra+=(--cpu --max-len-a 1.2 --max-len-b 10); fi
  [ ${#runs[@]} -gt 0 ] || runs=("softmax${SIZE_SUFFIX:-}" "rfa${SIZE_SUFFIX:-}" "rfa_gate${SIZE_SUFFIX:-}")
  for run in "${runs[@]}"; do
    ckpt=$({ find "$WORK/eval/$run" -maxdepth 1 -name 'checkpoint.u*.avg*.pt' 2>/dev/null || true; } |
      sed -E 's/.*checkpoint\.u([0-9]+)\.avg[0-9]+\.pt$/\1 &/' | sort -n | tail -n 1 | cut -d' ' -f2)
    [ -n "$ckpt" ] || ckpt=$WORK/checkpoints/$run/checkpoint_last.pt
    [ -f "$ckpt" ] || die "no model for run '$run' (neither $WORK/eval/$run/checkpoint.u*.avg*.pt nor $ckpt): train it first"
    log "speed: $run <- $ckpt"
    models+=(--model "$run=$ckpt")
  done
  generate_flags
  python "$RECIPES/../bench/decode.py" checkpoint "$DATA_BIN" --user-dir "$USER_DIR" --source-lang "$SRC" \
    --target-lang "$TGT" --repeats "${REPEATS:-1}" --out "$WORK/eval/speed.json" "${models[@]}" \
    -- "${GENERATE_FLAGS[@]}" ${extra[@]+"${extra[@]}"}
  python "$RECIPES/../bench/report.py" "$WORK/eval/speed.json" --out "$WORK/eval/speed.md"
  log "speed and memory table: $WORK/eval/speed.md"
}
