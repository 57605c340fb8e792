#!/usr/bin/env bash
# Device call (one H200 or H100): compile_generate with DecodeGemv on by default (issue 28). Under one
# deadline (DEADLINE s): bench_decode 1b with transformers' recipe, sw_full_nogemv (the default before,
# cuBLAS at decode), sw_full (the new default) and sw_full_pdl, the bf16/fp32 checks on; then the GPU
# tests of the folders the change touches (tests/library, tests/models: compile_generate's default
# under full graphs), failures named; then, with time left, bench_llama's 7B-sized stack at 1/8/64 tokens.
# Results under $OUT. From the repository root: bash benchmarks/device/session_default_gemv.sh
source benchmarks/device/_setup.sh
timeout "${DECODE_LIMIT:-260}" python3 benchmarks/bench_decode.py --models 1b \
  --contenders "${CONTENDERS:-hf_recipe,sw_full_nogemv,sw_full,sw_full_pdl}" --rounds 3 --generate-repeats 1 \
  --check-layers "${CHECK_LAYERS:-2}" --out "$OUT/decode" 2>&1 | grep -v "Warn\|warn\|skipping" \
  | tee "$OUT/bench_decode.log" | tail -12
T=$(left); echo "left for the tests: $T s"
timeout "${TEST_LIMIT:-200}" python3 -m pytest -q -rfE -p no:cacheprovider -m "gpu or inductor" \
  ${TESTS:-tests/library tests/models} -n "${WORKERS:-8}" 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt" \
  | grep -E "passed|failed|FAILED|ERROR|Error" | head -20
T=$(left); echo "left for bench_llama: $T s"
[ "$T" -gt 60 ] && mkdir -p "$OUT/llama" && timeout $(( T - 5 )) python3 benchmarks/bench_llama.py \
  --out "$OUT/llama" --repeats 3 --tokens 1,8,64 --profile \
  --contenders "shapewise static+full cudagraph,shapewise full cudagraph+DecodeGemv,shapewise full cudagraph+DecodeGemv64" 2>&1 | tail -12
echo done
