#!/usr/bin/env bash
# Set up the Python environment rfa_fairseq runs in (idempotent; fast when already done).
#
#   bash scripts/setup_env.sh            # creates ./.venv if missing and installs the stack
#   RFA_USE_CURRENT_ENV=1 bash scripts/setup_env.sh   # install into the active Python instead
#                                                     # (e.g. a conda env with your CUDA torch)
#
# An already installed torch is kept (a GPU user's CUDA build); otherwise torch==2.13.0 is
# installed. fairseq-fixed (fairseq main + Python 3.11 fixes) is built without build isolation
# and without dependency resolution, because its metadata asks for torchaudio, which would
# replace torch; its real dependencies are then installed by name.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TORCH_VERSION=${RFA_TORCH_VERSION:-2.13.0}
FAIRSEQ_VERSION=0.12.3.1

if [ "${RFA_USE_CURRENT_ENV:-0}" = "1" ]; then
  PY=$(command -v python || command -v python3)
else
  VENV=${RFA_VENV:-$ROOT/.venv}
  if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
  PY=$VENV/bin/python
fi

stamp=$("$PY" - <<'PY' 2>/dev/null || true
import importlib.metadata as m
try:
    import torch, fairseq, sacrebleu, sacremoses, sentencepiece, pytest, xdist, hypothesis, matplotlib  # noqa
    m.version("rfa_fairseq")
    m.version("ctranslate2")  # optional, below: where it cannot install, setup runs its install steps every time
    m.version("fla-core")  # optional too
    print(m.version("fairseq-fixed"))
except Exception:
    pass
PY
)
if [ "$stamp" = "$FAIRSEQ_VERSION" ]; then
  echo "[setup] environment ready ($PY)"
  exit 0
fi

pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
echo "[setup] installing the stack into $("$PY" -c 'import sys; print(sys.prefix)') (a few minutes the first time)"
pip_install --upgrade pip setuptools wheel
if "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup] keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  pip_install "torch==$TORCH_VERSION"
fi
pip_install cython numpy
if ! "$PY" -c "import importlib.metadata as m; assert m.version('fairseq-fixed') == '$FAIRSEQ_VERSION'" 2>/dev/null; then
  pip_install --no-build-isolation --no-deps "fairseq-fixed==$FAIRSEQ_VERSION"
fi
pip_install "hydra-core==1.3.2" "omegaconf==2.3.0" regex sacrebleu sacremoses tqdm bitarray scikit-learn packaging cffi \
  sentencepiece pytest pytest-xdist hypothesis "matplotlib>=3.7" ninja
pip_install --no-build-isolation --no-deps -e .
# optional, pinned as setup.py's "bench" extra: CTranslate2 for bench/decode.py (tests skip its cases without it)
pip_install "ctranslate2==4.8.5" || echo "[setup] warning: ctranslate2 4.8.5 did not install; bench/decode.py runs without it"
# optional, pinned as setup.py's "gpu" extra: fla-core's kernels for --rfa-backend fla (the tests run them in
# Triton's interpreter on a CPU); a triton that came with a CUDA torch is kept
"$PY" -c "import triton" 2>/dev/null || pip_install "triton==3.7.1" || echo "[setup] warning: triton did not install"
pip_install --no-deps "fla-core==0.6.0" einops || echo "[setup] warning: fla-core did not install; --rfa-backend fla is unavailable"
"$PY" -c "import torch, fairseq, rfa_fairseq; print('[setup] ok: torch', torch.__version__, '| fairseq', fairseq.__version__, '| rfa_fairseq', rfa_fairseq.__version__)"
# the C++ (torch's extension API): the compiled step, built now for this CPU, cached for every later process
"$PY" -c "from rfa_fairseq.engines import compiled; print('[setup] compiled step:', 'built' if compiled.load() else 'unavailable')"
