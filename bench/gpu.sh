#!/usr/bin/env bash
# The GPU check, for an H100/H200 host: MFU of the trainer on a ~1B model in bf16
# for recompute none/selective/full, the largest micro-batch that fits vs the planner's
# prediction, and step time with the optimizer offloaded to the CPU. Writes gpu_results.json and
# gpu_results.md into --out (default runs/gpu-check). Without CUDA it says so, skips the GPU
# parts and exits 0. Options: python -m llmscale.bench.gpu --help
set -euo pipefail
cd "$(dirname "$0")/.."
# LLMSCALE_PYTHON=python3: a Python that already has torch (e.g. a GPU host's CUDA build), with
# the source tree on its path instead of this project's .venv (which pins the CPU build).
if [ -n "${LLMSCALE_PYTHON:-}" ]; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    exec "$LLMSCALE_PYTHON" -m llmscale.bench.gpu "$@"
fi
[ -x .venv/bin/python ] || make .venv/.installed
exec .venv/bin/python -m llmscale.bench.gpu "$@"
