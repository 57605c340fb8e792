#!/usr/bin/env bash
# Device call (one H200), under one deadline (DEADLINE s from the start): bench_decode 1b (compile_generate's
# defaults, the same on DTensor weights: issue 26's host targets; 91 s on 2026-12-05; CONTENDERS to change)
# and host_breakdown.py (where a decode step's host time goes, with a cProfile of 200 steps) first, on a
# quiet machine (right after the GPU suite host times came out 1.8x higher and the GPU step 6% longer:
# results/h200_20261205), then the whole GPU suite (`make gpu-test`'s selection, 8 xdist workers) with the time left (it took 315 s on 2026-12-05).
# Results under $OUT. Run from the repository root on the device machine: bash benchmarks/device/session_close.sh
# On a cold machine (its Inductor cache empty) the two benchmarks compile for minutes: the defaults of
# BENCH_LIMIT and BREAKDOWN_LIMIT allow for it (150 s and 60 s did not, 2026-12-05). SUITE=0 skips the suite.
source benchmarks/device/_setup.sh
timeout "${BENCH_LIMIT:-300}" python3 benchmarks/bench_decode.py --models 1b \
  --contenders "${CONTENDERS:-sw_full,sw_full_dtensor}" --rounds 3 --generate-repeats 1 --check-layers 0 \
  --out "$OUT" 2>&1 | grep -v "Warn\|warn\|skipping" | tee "$OUT/bench_decode.log" | tail -10
timeout "${BREAKDOWN_LIMIT:-150}" python3 benchmarks/device/host_breakdown.py --calls 30 --profile 200 \
  --out "$OUT/host_breakdown.json" 2>&1 | tee "$OUT/host_breakdown.log" | tail -30
if [ "${SUITE:-1}" = 1 ]; then
  T=$(left); echo "left for the suite: $T s"
  OUT=$OUT LIMIT=$(( T - 5 )) bash benchmarks/device/session_suite.sh
fi
echo done
