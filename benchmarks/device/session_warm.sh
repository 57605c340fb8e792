#!/usr/bin/env bash
# Device call (one H200), under one deadline (DEADLINE s): the warm-start tests on this machine's torch
# (2.11), the 1B compile_generate cold and warm starts with and without warm_start (fresh processes),
# then with what time is left the GPU tests of generate() and CUDA graphs. Results under $OUT.
# Run from the repository root on the device machine: bash benchmarks/device/session_warm.sh
DEADLINE_DEFAULT=540
source benchmarks/device/_setup.sh
N=""
python3 -c "import xdist" 2>/dev/null && N="-n 4"
timeout ${WARM_TESTS_S:-150} python3 -m pytest -q -rfE $N -p no:cacheprovider tests/test_warm.py >"$OUT/warm_tests.txt" 2>&1
echo "warm tests rc=$?" | tee -a "$OUT/warm_tests.txt"; tail -3 "$OUT/warm_tests.txt"
T=$(left); echo "left for the starts: $T s"
[ "$T" -gt 100 ] && timeout "$T" python3 benchmarks/device/cold_generate.py --out "$OUT" --warm --timeout 90 2>&1 \
  | cut -c1-600 | tail -4
T=$(left); echo "left for the GPU tests: $T s"
[ "$T" -gt 40 ] && timeout "$T" python3 -m pytest -q -rfE $N -m gpu -p no:cacheprovider tests/models/test_generate.py \
  tests/dispatch/test_cudagraphs.py >"$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.txt"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.txt" | tail -8
echo done
