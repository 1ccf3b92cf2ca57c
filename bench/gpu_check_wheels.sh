#!/usr/bin/env bash
# Fetch, where a package registry is reachable, the wheels a GPU machine without network
# needs for bench/gpu_check.sh, into .whl/ (git-ignored via .git/info/exclude):
#   bench/gpu_check_wheels.sh [PYTHON_VERSION]      # default 3.12, the GPU image's python3
# The lent GPU image (/work/.library/device/KINDS.md) has torch, torchvision, onnx,
# onnxruntime, typer, rich, nvidia-ml-py, ... but not pydantic, which every dtrain config
# needs. The versions are this checkout's environment's, so the two agree.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PY=${PYTHON:-.venv/bin/python}
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
for dist in pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
  version=$("$PY" -c "import importlib.metadata as m; print(m.version('$dist'))")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$dist==$version"
done
ls -l .whl
