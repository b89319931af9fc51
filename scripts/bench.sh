#!/usr/bin/env bash
# The benchmark suite (docs/benchmarks.md): decoding speed and memory (translation and LM),
# training speed and memory, a decoding-step profile, then the JSON, the PNG figure and the
# markdown tables under bench/results/ (or $BENCH_OUT).
#
#   bash scripts/bench.sh              # the full suite; about an hour on a 2-core CPU
#   BENCH_QUICK=1 bash scripts/bench.sh   # short lengths only, a few minutes
#
# Run it on a quiet machine. BENCH_THREADS sets torch's CPU threads (default: torch's choice).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh >/dev/null
PY=${RFA_VENV:-$(pwd)/.venv}/bin/python
[ "${RFA_USE_CURRENT_ENV:-0}" = "1" ] && PY=$(command -v python || command -v python3)
"$PY" -c "import matplotlib" 2>/dev/null || "$PY" -m pip install --quiet "matplotlib>=3.7"  # RFA_USE_CURRENT_ENV
OUT=${BENCH_OUT:-bench/results}
mkdir -p "$OUT"
THREADS=()
[ -n "${BENCH_THREADS:-}" ] && THREADS=(--threads "$BENCH_THREADS")
export PYTHONWARNINGS=ignore

if [ -n "${BENCH_QUICK:-}" ]; then
  TR=(--lengths 32 128 256 --repeats 2)
  LM=(--lengths 64 256 --repeats 2)
  TRAIN=(--lengths 256 512 --repeats 2 --tokens-per-batch 2048)
  PROF=(--lengths 32 128)
else
  TR=(--lengths 32 128 512 2048 4096 --repeats 3)
  LM=(--lengths 128 512 2048 8192 --repeats 3)
  TRAIN=(--lengths 256 512 1024 4096 8192 --repeats 3)
  PROF=(--lengths 32 512)
fi

"$PY" bench/decode_speed.py --task translation "${TR[@]}" "${THREADS[@]}" --out "$OUT/decode_translation.json"
"$PY" bench/decode_speed.py --task lm --batch 1 --beam 1 "${LM[@]}" "${THREADS[@]}" --out "$OUT/decode_lm.json"
"$PY" bench/train_speed.py --check "${TRAIN[@]}" "${THREADS[@]}" --out "$OUT/train_speed.json"
"$PY" bench/profile_decode.py "${PROF[@]}" "${THREADS[@]}" --out "$OUT/profile_decode.json"
"$PY" bench/plot.py --translation "$OUT/decode_translation.json" --lm "$OUT/decode_lm.json" \
  --train "$OUT/train_speed.json" --out "$OUT/benchmarks.png"
"$PY" bench/report.py --translation "$OUT/decode_translation.json" --lm "$OUT/decode_lm.json" \
  --train "$OUT/train_speed.json" --profile "$OUT/profile_decode.json" --out "$OUT/report.md" >/dev/null
echo "results: $OUT/*.json, $OUT/benchmarks.png, $OUT/report.md"
