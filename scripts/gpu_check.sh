#!/usr/bin/env bash
# What rfa_fairseq does on this machine's NVIDIA GPU: the GPU tests (fla's kernels against the naive loop, the
# models' loss and gradients across --rfa-backend), then the GPU benchmarks of docs/benchmarks.md, their JSON
# and one markdown table in work/gpu_check/ (or the folder given).
#
#   bash scripts/gpu_check.sh [OUT] [--precision]      # Python: $PYTHON, else .venv's, else python3
#
# Needs the stack with a CUDA torch (RFA_USE_CURRENT_ENV=1 bash scripts/setup_env.sh, or pip install .[gpu]
# beside it). Decoding: one LM sequence to 4,096 tokens, greedy, and beam-4 translation of 8 sources to 512 tokens,
# softmax against RFA-Gate, eager and with its steps replayed as CUDA graphs (--cuda-graphs). Then training: the
# 6 x 512 LM in bf16, 16,384 tokens per step from 2,048 to 16,384 tokens per sequence, fairseq softmax, the SDPA
# baseline and RFA-Gate on torch's and fla's kernels (where fla refuses RFA-Gate's backward, Hopper with Triton 3.4
# to 3.7.0, its guard is lifted for this run after a gradient check: bench/train.py --fla-unguard). With
# --precision, also mixed precision: RFA-Gate trained on Multi30k (results/quality.py's precision setting, 600
# updates) in fp32, --bf16 and --fp16, by their final validation loss (three trainings: minutes more).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-work/gpu_check}
PRECISION=${2:-}
[ -z "$PRECISION" ] || [ "$PRECISION" = --precision ] || { echo "usage: bash scripts/gpu_check.sh [OUT] [--precision]" >&2; exit 2; }
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$OUT"
"$PY" - <<'EOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("scripts/gpu_check.sh needs an NVIDIA GPU that torch sees (torch.cuda.is_available() is False)")
print(f"[gpu_check] {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
EOF
"$PY" -c "import triton, fla; print('[gpu_check] triton', triton.__version__, '| fla-core', fla.__version__)" \
  || echo "[gpu_check] fla-core is not installed: the fla rows will fail (pip install .[gpu])"

"$PY" -m pytest -q -p no:cacheprovider tests/gpu tests/ops/test_fla.py tests/models/test_backends.py tests/models/test_step_graphs.py \
  > "$OUT/tests.log" 2>&1 || echo "[gpu_check] some GPU tests failed: $OUT/tests.log"
tail -n 3 "$OUT/tests.log"
"$PY" bench/decode.py synthetic --device cuda --task lm --batch 1 --lengths 512 4096 --models softmax rfa_gate rfa_gate_graphs \
  --repeats 2 --out "$OUT/decode_lm_b1.json" || echo "[gpu_check] the LM decoding benchmark failed (above)"
"$PY" bench/decode.py synthetic --device cuda --task translation --batch 8 --beam 4 --lengths 512 \
  --models softmax rfa_gate_softcross rfa_gate_softcross_graphs --repeats 2 --out "$OUT/decode_translation_b8.json" \
  || echo "[gpu_check] the translation decoding benchmark failed (above)"
"$PY" bench/train.py lm --device cuda --dtype bf16 --variants softmax sdpa rfa_gate_torch rfa_gate_fla \
  --lengths 2048 4096 8192 16384 --tokens-per-batch 16384 --repeats 3 --max-seconds 60 --fla-unguard \
  --out "$OUT/train_lm_bf16.json" \
  || echo "[gpu_check] the training benchmark failed (above); the rest still runs"
[ -z "$PRECISION" ] || "$PY" results/quality.py --setting precision --variants gate_softcross gate_softcross_bf16 gate_softcross_fp16 \
  --out "$OUT/precision.jsonl" --work "$OUT/precision" || echo "[gpu_check] the mixed-precision runs failed (above)"
if [ -f "$OUT/precision.jsonl" ]; then "$PY" results/quality.py --report --out "$OUT/precision.jsonl" > "$OUT/precision.md"; fi
shopt -s nullglob
"$PY" bench/report.py "$OUT"/*.json --out "$OUT/table.md"
cat "$OUT/table.md"
if [ -f "$OUT/precision.md" ]; then cat "$OUT/precision.md"; fi
