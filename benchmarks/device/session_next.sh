#!/usr/bin/env bash
# Device call (one H100 or H200), what 2026-12-07's evening left owed: the GPU tests of the folders it changed
# (tests/library: DecodeGemv's GLU timing and its GPU test, never passed on a GPU; tests/lower: the traced size's
# pieces shared with the workers), then the 1B compile_generate's cold starts, whole against the prompt trace
# split (whole_traces={"seq": 1}), serial and with 4 workers, on one host (cold_generate.py; ORDER's entries
# W[+sdpa[:prefill]]). One deadline (DEADLINE s); results under $OUT (all.tgz). From the repository root:
#   DEADLINE=585 bash benchmarks/device/session_next.sh
source benchmarks/device/_setup.sh
TORCHINDUCTOR_COMPILE_THREADS=2 timeout "${TEST_LIMIT:-200}" python3 -m pytest -q -rfE -n 8 -m gpu -p no:cacheprovider \
  ${TESTS:-tests/library tests/lower} >"$OUT/gpu_tests.txt" 2>&1
echo "tests rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.txt" | tail -12
timeout $(( $(left) - 5 )) python3 benchmarks/device/cold_generate.py --out "$OUT/cold" \
  --workers "${ORDER:-4,4+sdpa:prefill,1,1+sdpa:prefill}" --timeout "${START_LIMIT:-150}" 2>&1 | cut -c1-300 | tail -8
echo done
