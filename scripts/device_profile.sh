#!/usr/bin/env bash
# Fit the modeled executor's cost model on a real GPU: the embedded torch executor with an 8B-shaped model
# (Llama-3-8B's sizes, random weights, bf16), profiled with the large plan, written where it comes back.
#
# For a session whose task is lent a device machine (the library's `device` tool; 15 minutes in all).
# That machine has torch, numpy and tqdm but not pydantic, and nothing can be fetched there, so:
#
#   bash scripts/device_profile.sh wheels     # here, once: pydantic's wheels for its Python 3.12 into .whl/
#   # then one device `run`, carrying .whl:
#   #   run(command="bash scripts/device_profile.sh check; bash scripts/device_profile.sh bench; bash scripts/device_profile.sh run",
#   #       carry=[".whl"], timeout_s=540)
#   # and keep what came back: engine_adapter/profiles/h200-llama3-8b.json (plus the log)
#
# `run` takes extra `hintflow engine profile` options after it (e.g. `--repeats 1`); PROFILE_DEVICE,
# PROFILE_NAME and PROFILE_SHAPE (the model-size options) override the defaults, so the same path can be
# tried here on a CPU with a tiny shape first:
#   PROFILE_DEVICE=cpu PROFILE_SHAPE="--max-model-len 4096" OUT=/tmp/p bash scripts/device_profile.sh run --plan quick
set -euo pipefail
cd "$(dirname "$0")/.."

with_wheels() {  # the carried wheels, where the machine lacks them
  if ! python3 -c 'import pydantic, pydantic_settings, dotenv' 2> /dev/null && compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
  fi
}

case "${1:-}" in
  wheels)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    # the versions this checkout is tested with; pure-Python ones are any-platform wheels
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
      pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 typing_extensions==4.16.0 \
      pydantic-settings==2.14.1 python-dotenv==1.2.2
    ls .whl
    ;;
  run)
    shift
    with_wheels
    out="${OUT:?OUT: where the profile is written (the device tool sets it)}"
    mkdir -p "$out"
    device="${PROFILE_DEVICE:-cuda}"
    name="${PROFILE_NAME:-h200-llama3-8b}"
    # Llama-3-8B: hidden 4096, 32 layers, 32 heads / 8 KV heads (head_dim 128), MLP 14336, vocab 128256
    shape="${PROFILE_SHAPE:---hidden-size 4096 --num-layers 32 --num-heads 32 --num-kv-heads 8 --intermediate-size 14336 --vocab-size 128256 --dtype bfloat16 --max-model-len 24576}"
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    # shellcheck disable=SC2086  # the shape is a list of options
    PYTHONUNBUFFERED=1 python3 -c 'from hintflow.cli import main; main()' engine profile \
      --device "$device" --plan large --name "$name" --out "$out/$name.json" $shape "$@" 2>&1 | tee "$out/profile.log"
    ;;
  check)
    # the torch executor's correctness tests on the GPU (paged vs reference forward, tier copies through
    # pinned memory); without the conftest, which needs pytest-asyncio and Temporal
    with_wheels
    out="${OUT:-/tmp}"
    HINTFLOW_TEST_DEVICE="${PROFILE_DEVICE:-cuda}" python3 -m pytest --noconftest -q -p no:cacheprovider \
      tests/test_torch_executor.py 2>&1 | tee "$out/check.log"
    ;;
  bench)
    # attention kernels by input rank (scripts/sdpa_probe.py) and decode steps at the demo shape, on the GPU
    with_wheels
    out="${OUT:-/tmp}"
    device="${PROFILE_DEVICE:-cuda}"
    { python3 scripts/sdpa_probe.py "$device"; python3 scripts/decode_bench.py "$device"; } 2>&1 | tee "$out/bench.log"
    ;;
  *)
    echo "usage: $0 wheels | run [hintflow engine profile options] | check | bench" >&2
    exit 2
    ;;
esac
