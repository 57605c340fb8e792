#!/usr/bin/env bash
# Device call (one H100 or H200), issue 28 with the GEMV tuner timed in CUDA graphs (af994e4 on). Under one
# deadline (DEADLINE s), each step only with time left: the GPU tests named in TESTS (default: the
# tuner's and the grouped-decode tests, a worker of which aborted on 2026-12-06), TEST_LIMIT s; bench_decode 1b, sw_full_nogemv (cuBLAS at
# decode) against sw_full (DecodeGemv, the default), the bf16/fp32 checks on; then bench_llama's 7B-sized
# stack at 1/8/64 tokens, profiled (kernels and each kernel's GPU µs per forward, in llama/results.json).
# DECODE_LIMIT=0 leaves bench_decode out. Results under $OUT (packed into all.tgz). From the repository root:
#   bash benchmarks/device/session_decode_llama.sh
source benchmarks/device/_setup.sh
[ "${TEST_LIMIT:-100}" -gt 0 ] && timeout "${TEST_LIMIT:-100}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
  -n "${WORKERS:-4}" ${TESTS:-tests/library/test_gemv_store.py tests/library/test_grouped_decode.py} 2>&1 | tail -30 \
  | tee "$OUT/gpu_tests.txt" | grep -E "passed|failed|FAILED|ERROR|Error|Fatal" | head -20
[ "${DECODE_LIMIT:-300}" -gt 0 ] && timeout "${DECODE_LIMIT:-300}" python3 benchmarks/bench_decode.py --models 1b \
  --contenders "${CONTENDERS:-sw_full_nogemv,sw_full}" --rounds 3 --generate-repeats 1 \
  --check-layers "${CHECK_LAYERS:-2}" --out "$OUT/decode" 2>&1 | grep -v "Warn\|warn\|skipping" \
  | tee "$OUT/bench_decode.log" | tail -12
T=$(left); echo "left for bench_llama: $T s"
[ "$T" -gt 60 ] && mkdir -p "$OUT/llama" && timeout $(( T - 5 )) python3 benchmarks/bench_llama.py \
  --out "$OUT/llama" --repeats 3 --tokens "${TOKENS:-1,8,64}" --profile \
  --contenders "${LLAMA_CONTENDERS:-shapewise static+full cudagraph,shapewise full cudagraph+DecodeGemv,shapewise full cudagraph+DecodeGemv64}" \
  2>&1 | tail -14
echo done
