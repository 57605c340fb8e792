#!/usr/bin/env bash
# Device call (one H200), under one deadline (DEADLINE s from the start): the whole GPU suite
# (`make gpu-test`'s selection, 8 xdist workers, 2 Inductor compile threads each), then bench_decode 1b
# (transformers' recipe, compile_generate's defaults, the same on DTensor weights), then with what time
# is left host_breakdown.py (where a decode step's host time goes). Results under $OUT.
# Run from the repository root on the device machine: bash benchmarks/device/session_close.sh
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $(( ${DEADLINE:-585} - ($(date +%s) - START) )); }
OUT=$OUT LIMIT=${SUITE_LIMIT:-380} bash benchmarks/device/session_suite.sh
T=$(left); echo "left for the bench: $T s"
[ "$T" -gt 90 ] && timeout "$T" python3 benchmarks/bench_decode.py --models 1b \
  --contenders "${CONTENDERS:-hf_recipe,sw_full,sw_full_dtensor}" --rounds 3 --generate-repeats 3 --check-layers 2 \
  --out "$OUT" 2>&1 | grep -v "Warn\|warn\|skipping" | tail -10
T=$(left); echo "left for host_breakdown: $T s"
[ "$T" -gt 40 ] && timeout "$T" python3 benchmarks/device/host_breakdown.py --calls 30 \
  --out "$OUT/host_breakdown.json" 2>&1 | tail -30
echo done
