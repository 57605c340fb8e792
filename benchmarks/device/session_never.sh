#!/usr/bin/env bash
# Device call (one H100 or H200), 2026-12-08: wait_for_workers="never" (every variant a compile worker's, the first
# calls eager meanwhile, CUDA graphs captured once a size's variants are in). Under one deadline (DEADLINE s): the
# GPU tests of the folders it touches (TESTS, default tests/lower tests/library tests/models; TEST_LIMIT s; also
# the owed GPU run of compile_generate's gemv_norm default), then the 1B's cold starts (cold_generate.py, fresh
# process and empty caches each; ORDER, default 4, 4+default:never, then 1: the serial baseline last, cut first).
# Results under $OUT (all.tgz). From the root:
#   DEADLINE=585 bash benchmarks/device/session_never.sh
source benchmarks/device/_setup.sh
if [ "${TEST_LIMIT:-200}" -gt 0 ]; then
  timeout "${TEST_LIMIT:-200}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu -n 8 \
    ${TESTS:-tests/lower tests/library tests/models} >"$OUT/gpu_tests.txt" 2>&1
  echo "tests rc=$?"; tail -5 "$OUT/gpu_tests.txt"
fi
timeout $(( $(left) - 5 )) python3 benchmarks/device/cold_generate.py --out "$OUT/cold" \
  --workers "${ORDER:-4,4+default:never,1}" --timeout "${CHILD_TIMEOUT:-120}" 2>&1 | cut -c1-400 | tail -6
echo done
