#!/usr/bin/env bash
# Run the test suite (sets up the environment first). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=${RFA_VENV:-$(pwd)/.venv}/bin/python
[ "${RFA_USE_CURRENT_ENV:-0}" = "1" ] && PY=$(command -v python || command -v python3)
# one worker per core (pytest-xdist; a file's tests stay together), each torch on one thread
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m pytest tests -q -p no:cacheprovider -n "${RFA_TEST_WORKERS:-auto}" --dist loadfile "$@"
