#!/usr/bin/env bash
# Device call (two H200s): GPU tests of the kernels, passes and NCCL paths, then bench_tp.
# Run from the repository root on the device machine: bash benchmarks/device/session_tp.sh [bench_tp args]
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpus.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/library tests/passes tests/distributed 2>&1 \
    | tail -20 | tee "$OUT/gpu_tests.txt"
fi
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench_tp.py --out "$OUT/tp" "$@" > "$OUT/bench_tp.log" 2>&1
echo "bench_tp exit $?"
# Per-rank JSON files and logs travel as one archive (many small files may not all come back).
tar czf "$OUT/tp_ranks.tgz" -C "$OUT/tp" $(cd "$OUT/tp" && ls -d tp* logs 2>/dev/null) && \
  rm -rf "$OUT"/tp/tp[0-9]* "$OUT/tp/logs"
tail -45 "$OUT/tp/table.md"
