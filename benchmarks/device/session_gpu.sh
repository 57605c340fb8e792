#!/usr/bin/env bash
# Device call (one H200): the GPU tests of the parts touched (CUDA graphs and the runner, lean
# calls, direct calls, DecodeGemv and its tuning, the transformers zoo on CUDA), then the
# host-path benchmark, then (GEMV=1) the gemv kernel against cuBLAS at the decode row counts.
# Run from the repository root on the device machine: bash benchmarks/device/session_gpu.sh
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpus.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/dispatch tests/distributed tests/lower \
    tests/passes tests/library tests/models tests/test_direct.py 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_direct.py 2>&1 | tail -3 | tee -a "$OUT/gpu_tests.txt"
fi
timeout 240 python3 benchmarks/bench_host.py --device cuda --out "$OUT/host_h200" 2>&1 | tail -60
if [ "${GEMV:-0}" = 1 ]; then
  timeout 200 python3 benchmarks/bench_gemv.py --out "$OUT/gemv_h200" 2>&1 | tail -30
fi
