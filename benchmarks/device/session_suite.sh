#!/usr/bin/env bash
# Device call (one H200): the whole GPU suite (`make gpu-test`: every test marked gpu or inductor),
# on 4 workers where pytest-xdist is installed there, the full log under $OUT.
# Run from the repository root on the device machine: bash benchmarks/device/session_suite.sh
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/gpus.txt"
N=""
python3 -c "import xdist" 2>/dev/null && N="-n ${WORKERS:-4}"
timeout "${LIMIT:-540}" python3 -m pytest -q $N -m "(gpu or inductor) and not fuzz" -p no:cacheprovider \
  --durations=25 ${TESTS:-tests} >"$OUT/gpu_suite.txt" 2>&1
echo "rc=$?" >>"$OUT/gpu_suite.txt"
grep -E "passed|failed|error|^FAILED|^ERROR|rc=" "$OUT/gpu_suite.txt" | tail -40
