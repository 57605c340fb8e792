#!/usr/bin/env bash
# Device call (one H200): generate() with direct calls past Dynamo's frame.
#   PART=1: the tests of the parts touched (direct calls, generate, DTensor weights, CUDA graphs;
#           all of tests/models/test_generate.py and tests/test_direct.py, CPU tests included:
#           the device has its own transformers), then bench_generate with plain weights.
#   PART=3: the GPU tests of the parts touched, bench_generate with DTensor weights (direct,
#           frame, direct: one process), bench_dtensor (world 1).
#   PART=2: the generate tests again (CPU and GPU), bench_generate with plain weights, the two
#           shapewise contenders interleaved twice (one process: a contender's place in the order
#           can cost it), with DTensor weights (world size 1), then bench_dtensor (world 1).
# Run from the repository root on the device machine: PART=1 bash benchmarks/device/session_generate.sh
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CONTENDERS=${CONTENDERS:-eager,hf_recipe,shapewise,shapewise_frame}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/gpus.txt"
if [ "${PART:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/models/test_generate.py tests/test_direct.py 2>&1 \
    | tail -15 | tee "$OUT/gpu_tests.txt"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/distributed tests/dispatch 2>&1 \
    | tail -15 | tee -a "$OUT/gpu_tests.txt"
  timeout 280 python3 benchmarks/bench_generate.py --contenders "$CONTENDERS" --out "$OUT/gen" 2>&1 | tail -25
elif [ "${PART}" = 3 ]; then
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/distributed tests/dispatch \
    tests/models/test_generate.py 2>&1 | tail -6 | tee "$OUT/gpu_tests.txt"
  timeout 200 python3 benchmarks/bench_generate.py --dtensor --contenders shapewise,shapewise_frame,shapewise \
    --out "$OUT/gen_dtensor_order" 2>&1 | tail -9
  timeout 190 python3 benchmarks/bench_dtensor.py --out "$OUT/dtensor_h200" 2>&1 | tail -12
else
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/models/test_generate.py 2>&1 | tail -4 \
    | tee "$OUT/gpu_tests.txt"
  timeout 150 python3 benchmarks/bench_generate.py --contenders shapewise_frame,shapewise,shapewise_frame,shapewise \
    --out "$OUT/gen_order" 2>&1 | tail -12
  timeout 150 python3 benchmarks/bench_generate.py --dtensor --contenders shapewise_frame,shapewise,hf_recipe \
    --out "$OUT/gen_dtensor" 2>&1 | tail -12
  timeout 200 python3 benchmarks/bench_dtensor.py --out "$OUT/dtensor_h200" 2>&1 | tail -25
fi
