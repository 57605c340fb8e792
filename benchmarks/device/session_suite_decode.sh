#!/usr/bin/env bash
# Device call (one H100 or H200), 2026-12-08: the whole GPU suite (`make gpu-test`'s selection; SUITE_LIMIT s),
# then bench_decode's 1B with the time left: compile_generate's default (sw_full: DecodeGemv with the norm in
# one-row products) against gemv_norm=False (sw_full_nonorm) and transformers' recipe, GENERATE_REPEATS generate()
# repeats. One deadline (DEADLINE s); results under $OUT (all.tgz). From the root:
#   DEADLINE=585 SUITE_LIMIT=360 bash benchmarks/device/session_suite_decode.sh
source benchmarks/device/_setup.sh
gpu_suite "${SUITE_LIMIT:-360}"
GENERATE_REPEATS=${GENERATE_REPEATS:-3} decode_1b "${CONTENDERS:-sw_full,sw_full_nonorm,hf_recipe}"
echo done
