#!/usr/bin/env bash
# Device call (one H100 or H200): programmatic dependent launch, gemv_glu and GEMVs of up to 64 rows
# (issue 28). Under one deadline (DEADLINE s), each step only with time left: the library's GPU tests (the PDL
# chains in CUDA graphs, the GLU kernel); bench_decode 1b with sw_full, sw_full_pdl (Inductor's kernels and the
# attention with PDL) and sw_full_gemv_pdl (the GEMVs too, the down projection with its activation), the
# bf16/fp32 checks on; bench_llama's 7B-sized stack at 1/8/64 tokens (full graph; + Inductor PDL; +
# DecodeGemv(max_tokens=64) with and without PDL); bench_gemv on the 1B's fused shapes (cuBLAS, the kernel,
# the kernel with PDL). Results under $OUT. From the repository root: bash benchmarks/device/session_pdl.sh
source benchmarks/device/_setup.sh
mkdir -p "$OUT/llama"
timeout "${TEST_LIMIT:-100}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/library -n 4 2>&1 \
  | tail -25 | tee "$OUT/gpu_library.txt"
T=$(left); echo "left for bench_decode: $T s"
timeout $(( T < ${DECODE_LIMIT:-280} ? T : ${DECODE_LIMIT:-280} )) python3 benchmarks/bench_decode.py --models 1b \
  --contenders "${CONTENDERS:-sw_full_nogemv,sw_full,sw_full_pdl}" --rounds 3 --generate-repeats 1 \
  --check-layers "${CHECK_LAYERS:-2}" --out "$OUT/decode" 2>&1 | grep -v "Warn\|warn\|skipping" \
  | tee "$OUT/bench_decode.log" | tail -12
T=$(left); echo "left for bench_llama: $T s"
[ "$T" -gt 40 ] && timeout $(( T - 5 )) python3 benchmarks/bench_llama.py --out "$OUT/llama" --repeats 3 \
  --tokens 1,8,64 --contenders "shapewise static+full cudagraph,shapewise full cudagraph+DecodeGemv64+PDL,shapewise full cudagraph+PDL,shapewise full cudagraph+DecodeGemv64" \
  2>&1 | grep -v "Warn\|warn" | tee "$OUT/llama/log.txt" | tail -12
T=$(left); echo "left for bench_gemv: $T s"
[ "$T" -gt 40 ] && timeout $(( T - 3 )) python3 benchmarks/bench_gemv.py --shapes 1b --rows "${ROWS:-1}" \
  --repeats 3 --out "$OUT/gemv" 2>&1 | grep -v "Warn\|warn" | tail -8
echo done
