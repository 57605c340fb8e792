#!/usr/bin/env bash
# Device call (one H200): the GPU suite (`make gpu-test`: every test marked gpu or inductor), on 8
# workers with 2 Inductor compile threads each where pytest-xdist is installed there (the whole suite in
# 255-283 s, 2026-12-04; on 4 workers with 4 threads it did not finish in 390 s), one line per test in the
# log under $OUT (a run its limit cuts short still names what passed). Should it outgrow one call:
# SHARD=0/2 then SHARD=1/2 in two calls run half each (tests/conftest.py's SHAPEWISE_TEST_SHARD).
# COMPILE_THREADS: Inductor's compile threads per test worker (the conftest's default is 1, for CI's 2
# cores; this machine has 16).
# Run from the repository root on the device machine: SHARD=0/2 bash benchmarks/device/session_suite.sh
set -u
export PYTHONPATH=.
export TORCHINDUCTOR_COMPILE_THREADS=${COMPILE_THREADS:-2}
[ -n "${SHARD:-}" ] && export SHAPEWISE_TEST_SHARD=$SHARD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/gpus.txt"
N=""
python3 -c "import xdist" 2>/dev/null && N="-n ${WORKERS:-8}"
LOG="$OUT/gpu_suite${SHARD:+_${SHARD/\//of}}.txt"
timeout "${LIMIT:-540}" python3 -m pytest -v -rfE $N -m "(gpu or inductor) and not fuzz" -p no:cacheprovider \
  --durations=25 ${TESTS:-tests} >"$LOG" 2>&1
echo "rc=$?" >>"$LOG"
grep -cE " PASSED " "$LOG" | sed 's/^/passed so far: /'
grep -E "passed|failed|error|FAILED|ERROR|rc=" "$LOG" | grep -v " PASSED " | tail -40
