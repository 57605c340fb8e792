#!/usr/bin/env bash
# Device call (one H100 or H200), issue 28: DecodeGemv(norm=True), the RMSNorm before and the residual add after
# each decode GEMV in its kernel. Under one deadline (DEADLINE s), each step only with time left: the library's
# GPU tests (TESTS; the norm kernel against float64 at every config; TEST_LIMIT s); bench_llama's 7B-sized
# stack at TOKENS, DecodeGemv64 against DecodeGemv64+norm (profiled), LLAMA_ENV set for both (e.g.
# SHAPEWISE_GEMV_WDOT_MORE=1; DECODE_RESERVE s kept for what follows); bench_decode on the 1B, sw_full against
# sw_full_norm (step GPU time, kernels a step, generate()). Results under $OUT (all.tgz). From the root: bash benchmarks/device/session_norm.sh
source benchmarks/device/_setup.sh
[ "${TEST_LIMIT:-120}" -gt 0 ] && timeout "${TEST_LIMIT:-120}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
  -n 8 ${TESTS:-tests/library/test_norm_gemv.py tests/library/test_decode_gemv.py} 2>&1 | tail -30 \
  | tee "$OUT/gpu_tests.txt" | grep -E "passed|failed|FAILED|ERROR|Error" | head -20
T=$(left); echo "left for bench_llama: $T s"
[ "$T" -gt 50 ] && mkdir -p "$OUT/llama" && env ${LLAMA_ENV:-} timeout $(( T - ${DECODE_RESERVE:-0} - 5 )) python3 benchmarks/bench_llama.py \
  --out "$OUT/llama" --repeats 3 --tokens "${TOKENS:-1,16,64}" --profile \
  --contenders "shapewise full cudagraph+DecodeGemv64,shapewise full cudagraph+DecodeGemv64+norm" 2>&1 | tail -8
decode_1b "${CONTENDERS:-sw_full,sw_full_norm}"
echo done
