#!/usr/bin/env bash
# Device call (one H100 or H200), owed since 2026-12-07 (night): compile_generate's DecodeGemv with the norm by
# default (gemv_norm, one-row products only). Under one deadline (DEADLINE s): the GPU tests of the folders it
# touches (TESTS, default tests/library tests/models; TEST_LIMIT s, -m gpu); then bench_decode's 1B, sw_full (the
# default, norm on) against sw_full_nonorm (gemv_norm=False) and transformers' recipe, with three generate()
# repeats (GENERATE_REPEATS) so the tokens/s difference is more than one sample. Results under $OUT (all.tgz).
#   DEADLINE=585 bash benchmarks/device/session_gemv_norm.sh
source benchmarks/device/_setup.sh
if [ "${TEST_LIMIT:-240}" -gt 0 ]; then
  timeout "${TEST_LIMIT:-240}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu -n 8 \
    ${TESTS:-tests/library tests/models} >"$OUT/gpu_tests.txt" 2>&1
  echo "tests rc=$?"; tail -5 "$OUT/gpu_tests.txt"
fi
GENERATE_REPEATS=${GENERATE_REPEATS:-3} decode_1b "${CONTENDERS:-sw_full,sw_full_nonorm,hf_recipe}"
echo done
