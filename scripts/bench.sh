#!/usr/bin/env bash
# The benchmark suite (docs/benchmarks.md): decoding (translation and LM, random weights),
# training (LM decoder stack, encoder self-attention), then the tables and the figure, under
# work/bench/ (or $BENCH_OUT; bench/results holds the runs the docs cite). Run it on a quiet machine; BENCH_THREADS sets torch's CPU threads.
#
#   bash scripts/bench.sh                 # the full suite: about an hour on a 2-core CPU
#   BENCH_QUICK=1 bash scripts/bench.sh   # short lengths only, a few minutes
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh >/dev/null
PY=${RFA_VENV:-$(pwd)/.venv}/bin/python
[ "${RFA_USE_CURRENT_ENV:-0}" = "1" ] && PY=$(command -v python || command -v python3)
"$PY" -c "import matplotlib" 2>/dev/null || "$PY" -m pip install --quiet "matplotlib>=3.7"
OUT=${BENCH_OUT:-work/bench} && mkdir -p "$OUT" && export PYTHONWARNINGS=ignore
C=(${BENCH_THREADS:+--threads "$BENCH_THREADS"})
if [ -n "${BENCH_QUICK:-}" ]; then
  TR=(--lengths 32 128 --repeats 2) LM=(--lengths 64 256 --repeats 2)
  TRAIN=(--lengths 256 512 --repeats 2 --tokens-per-batch 2048) ENC=(--lengths 512 1024 --repeats 2)
else
  TR=(--lengths 32 128 512 2048 4096) LM=(--lengths 128 512 2048 8192)
  TRAIN=(--lengths 256 512 1024 4096 8192) ENC=(--lengths 1024 2048 4096)
fi
"$PY" bench/decode.py synthetic --task translation "${TR[@]}" "${C[@]}" --out "$OUT/decode_translation.json"
"$PY" bench/decode.py synthetic --task lm "${LM[@]}" "${C[@]}" --out "$OUT/decode_lm.json"
"$PY" bench/train.py lm "${TRAIN[@]}" "${C[@]}" --out "$OUT/train_lm.json"
"$PY" bench/train.py encoder "${ENC[@]}" "${C[@]}" --out "$OUT/train_encoder.json"
"$PY" bench/report.py "$OUT"/{decode_translation,decode_lm,train_lm,train_encoder}.json \
  --out "$OUT/report.md" --figure "$OUT/benchmarks.png"
echo "results: $OUT/*.json, $OUT/benchmarks.png, $OUT/report.md"
