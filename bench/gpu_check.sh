#!/usr/bin/env bash
# bench/gpu_check.py with whatever Python this machine has, offline (no package registry):
#   bench/gpu_check.sh [--dry-run] [--only STEPS] [--out DIR] [--budget S]
# The Python: $PYTHON, else .venv/bin/python when it imports torch, else python3.
# A Python without pydantic gets it from the wheels in .whl/ (bench/gpu_check_wheels.sh
# fetches them where a registry is reachable), installed into a private folder, never
# into the environment. dtrain runs from this checkout (PYTHONPATH), not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in .venv/bin/python python3; do
    if "$candidate" -c "import torch" 2>/dev/null; then PY=$candidate; break; fi
  done
fi
if [ -z "$PY" ]; then
  echo "gpu_check: no Python that imports torch (tried .venv/bin/python, python3); set PYTHON=..." >&2
  exit 2
fi
# Only for a Python that lacks them: wheels for another Python version would not install.
if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c "import pydantic" 2>/dev/null; then
  site=${TMPDIR:-/tmp}/dtrain-gpu-check-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: carried wheels installed into $site: $(cd .whl && ls *.whl | tr '\n' ' ')"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_check.py "$@"
