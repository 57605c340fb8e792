#!/usr/bin/env bash
# Device call (one H200): GPU tests (TESTS, default the library's), then the 1B decode step with each
# decode option (CONTENDERS: by default compile_generate's default and its default before fe44f12), in one process.
# Run from the repository root on the device machine: bash benchmarks/device/session_decode_options.sh
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout "${TEST_LIMIT:-180}" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider ${TESTS:-tests/library} \
  >"$OUT/gpu_tests.txt" 2>&1
echo "tests rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.txt" | tail -12
timeout "${BENCH_LIMIT:-360}" python3 benchmarks/bench_decode.py --models "${MODELS:-1b}" \
  --contenders "${CONTENDERS:-sw_full,sw_full_plain}" --rounds 3 \
  --generate-repeats "${REPEATS:-5}" --check-layers 2 --out "$OUT" 2>&1 | grep -v "Warn\|warn\|skipping" | tail -12
