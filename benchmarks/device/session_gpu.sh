#!/usr/bin/env bash
# Device call 1 (two H200s): the GPU tests of the parts this session touched (CUDA graphs and
# the runner, lean calls, DecodeGemv and its tuning store, NCCL), then the host-path benchmark.
# Run from the repository root on the device machine: bash benchmarks/device/session_gpu.sh
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpus.txt"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/dispatch tests/distributed tests/lower tests/passes \
  tests/kernels 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
timeout 200 python3 benchmarks/bench_host.py --device cuda --out "$OUT/host_h200" 2>&1 | tail -45
