#!/usr/bin/env bash
# One device call (two H200s): the GPU tests (one GPU and NCCL), then the host-path benchmark.
# Run from the repository root on the device machine: bash benchmarks/device/session_gpu.sh
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpus.txt"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
timeout 200 python3 benchmarks/bench_host.py --device cuda --out "$OUT/host_h200" 2>&1 | tail -40
