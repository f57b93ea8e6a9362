#!/usr/bin/env bash
# On one GPU, in under 8 minutes: the CUDA tests, then gpt-oss-120b's stages at their real size
# with their weights drawn in place (specpipe/bench/gpu_check.py): one 9-layer stage's forward
# for 1-16 rows and 1-8 sessions, and the 36 layers as four stages on the GPU with the reference
# run's link delays, tok/s beside 4.6 and the latency ceiling. Writes gpu_check.json to $OUT (or
# here). Uses python3 (a GPU machine's, with CUDA's torch) unless PYTHON names another.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# Only the model tests' own fixtures (tests/model/conftest.py): no Redis or database needed.
timeout 180 "$PY" -m pytest -q --confcutdir=tests/model -p no:cacheprovider tests/model/test_cuda.py
timeout 300 "$PY" -m specpipe.bench.gpu_check --device cuda --json "${OUT:-.}/gpu_check.json"
