#!/usr/bin/env bash
# Install hintflow into the current Python environment (3.11+).
#   scripts/install.sh        the package and its command, `hintflow`
#   scripts/install.sh dev    plus what the tests, ruff and mypy need
# torch comes first: on a machine without an NVIDIA GPU it takes the CPU build (torch==2.13.0 is a local
# wheel on our build machines; elsewhere PyTorch's CPU index), never a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
extras="${1:-}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch>=2.4,<3"
  else
    "$PY" -m pip install --quiet torch==2.13.0 \
      || "$PY" -m pip install --quiet "torch>=2.4,<3" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
if [ -n "$extras" ]; then
  "$PY" -m pip install --quiet -e ".[$extras]"
else
  "$PY" -m pip install --quiet -e .
fi
