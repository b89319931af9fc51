#!/usr/bin/env bash
# Run the test suite (sets up the environment first). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=${RFA_VENV:-$(pwd)/.venv}/bin/python
[ "${RFA_USE_CURRENT_ENV:-0}" = "1" ] && PY=$(command -v python || command -v python3)
exec "$PY" -m pytest tests -q -p no:cacheprovider "$@"
