#!/usr/bin/env bash
# Device call (one H100 or H200), 2026-12-08: the whole GPU suite (`make gpu-test`'s selection; SUITE_LIMIT s),
# then bench_decode's 1B with the time left: compile_generate's default (sw_full: DecodeGemv with the norm in
# one-row products) against gemv_norm=False (sw_full_nonorm) and transformers' recipe, GENERATE_REPEATS generate()
# repeats. One deadline (DEADLINE s); results under $OUT (all.tgz). From the root:
#   DEADLINE=585 SUITE_LIMIT=360 bash benchmarks/device/session_suite_decode.sh
source benchmarks/device/_setup.sh
export TORCHINDUCTOR_COMPILE_THREADS=2
timeout "${SUITE_LIMIT:-360}" python3 -m pytest -v -rfE -n 8 -m "(gpu or inductor) and not fuzz" -p no:cacheprovider \
  --durations=25 ${TESTS:-tests} >"$OUT/gpu_suite.txt" 2>&1
echo "suite rc=$?"; grep -cE " PASSED " "$OUT/gpu_suite.txt" | sed 's/^/passed so far: /'
grep -E "passed|failed|error|FAILED|ERROR" "$OUT/gpu_suite.txt" | grep -v " PASSED " | tail -30
unset TORCHINDUCTOR_COMPILE_THREADS
T=$(left); echo "left for bench_decode: $T s"
[ "$T" -gt 60 ] && timeout $(( T - 5 )) python3 benchmarks/bench_decode.py --models 1b \
  --contenders "${CONTENDERS:-sw_full,sw_full_nonorm,hf_recipe}" --rounds 3 \
  --generate-repeats "${GENERATE_REPEATS:-3}" --check-layers "${CHECK_LAYERS:-2}" --out "$OUT/decode" 2>&1 \
  | grep -v "Warn\|warn\|skipping" | tee "$OUT/bench_decode.log" | tail -12
echo done
