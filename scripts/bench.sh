#!/usr/bin/env bash
# The benchmark suite (docs/benchmarks.md): decoding (translation and LM, random weights, with a
# profile at two lengths), training (LM decoder stack, encoder self-attention), then the markdown
# tables and the figure, all under bench/results/ (or $BENCH_OUT).
#
#   bash scripts/bench.sh                 # the full suite: about an hour on a 2-core CPU
#   BENCH_QUICK=1 bash scripts/bench.sh   # short lengths only, a few minutes
#
# Run it on a quiet machine. BENCH_THREADS sets torch's CPU threads (default: torch's choice).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh >/dev/null
PY=${RFA_VENV:-$(pwd)/.venv}/bin/python
[ "${RFA_USE_CURRENT_ENV:-0}" = "1" ] && PY=$(command -v python || command -v python3)
"$PY" -c "import matplotlib" 2>/dev/null || "$PY" -m pip install --quiet "matplotlib>=3.7"
OUT=${BENCH_OUT:-bench/results}
mkdir -p "$OUT"
COMMON=(${BENCH_THREADS:+--threads "$BENCH_THREADS"})
export PYTHONWARNINGS=ignore
if [ -n "${BENCH_QUICK:-}" ]; then
  TR=(--lengths 32 128 --repeats 2) LM=(--lengths 64 256 --repeats 2) PROF=(--lengths 32 128 --repeats 1)
  TRAIN=(--lengths 256 512 --repeats 2 --tokens-per-batch 2048) ENC=(--lengths 512 1024 --repeats 2)
else
  TR=(--lengths 32 128 512 2048 4096) LM=(--lengths 128 512 2048 8192) PROF=(--lengths 32 512 --repeats 1)
  TRAIN=(--lengths 256 512 1024 4096 8192) ENC=(--lengths 1024 2048 4096)
fi
"$PY" bench/decode.py synthetic --task translation "${TR[@]}" "${COMMON[@]}" --out "$OUT/decode_translation.json"
"$PY" bench/decode.py synthetic --task lm "${LM[@]}" "${COMMON[@]}" --out "$OUT/decode_lm.json"
"$PY" bench/decode.py synthetic --task translation --models softmax rfa_gate --profile "${PROF[@]}" "${COMMON[@]}" \
  --out "$OUT/profile_decode.json"
"$PY" bench/train.py lm "${TRAIN[@]}" "${COMMON[@]}" --out "$OUT/train_lm.json"
"$PY" bench/train.py encoder "${ENC[@]}" "${COMMON[@]}" --out "$OUT/train_encoder.json"
"$PY" bench/report.py "$OUT"/{decode_translation,decode_lm,profile_decode,train_lm,train_encoder}.json \
  --out "$OUT/report.md" --figure "$OUT/benchmarks.png"
echo "results: $OUT/*.json, $OUT/benchmarks.png, $OUT/report.md"
