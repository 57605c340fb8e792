#!/usr/bin/env bash
# Device call (one H200 or H100), issue 28 with DecodeGemv on by default in compile_generate. Under one
# deadline (DEADLINE s), each step only with time left: bench_decode 1b with transformers' recipe,
# sw_full_nogemv (the default before: cuBLAS at decode), sw_full (the new default) and sw_full_pdl, the
# bf16/fp32 checks on; bench_gemv's 16-layer chain of the 1B's GEMVs at 1 row with PDL's trigger late
# (the default now) and early (as before); bench_llama's 7B-sized stack at 1/8/64 tokens, profiled.
# (The GPU tests: session_suite.sh.) Results under $OUT. From the repository root:
#   bash benchmarks/device/session_default_gemv.sh
source benchmarks/device/_setup.sh
timeout "${DECODE_LIMIT:-280}" python3 benchmarks/bench_decode.py --models 1b \
  --contenders "${CONTENDERS:-hf_recipe,sw_full_nogemv,sw_full,sw_full_pdl}" --rounds 3 --generate-repeats 1 \
  --check-layers "${CHECK_LAYERS:-2}" --out "$OUT/decode" 2>&1 | grep -v "Warn\|warn\|skipping" \
  | tee "$OUT/bench_decode.log" | tail -12
for trigger in late early; do
  T=$(left); echo "left for bench_gemv ($trigger): $T s"
  [ "$T" -gt 60 ] && SHAPEWISE_GEMV_PDL_TRIGGER=$trigger timeout "${GEMV_LIMIT:-90}" python3 benchmarks/bench_gemv.py \
    --shapes 1b --rows 1 --chain 16 --chain-rows 1 --repeats 3 --out "$OUT/gemv_$trigger" 2>&1 \
    | grep -v "Warn\|warn" | tee "$OUT/gemv_$trigger.log" | grep -v "^  " | tail -8
done
T=$(left); echo "left for bench_llama: $T s"
[ "$T" -gt 60 ] && mkdir -p "$OUT/llama" && timeout $(( T - 5 )) python3 benchmarks/bench_llama.py \
  --out "$OUT/llama" --repeats 3 --tokens 1,8,64 --profile \
  --contenders "shapewise static+full cudagraph,shapewise full cudagraph+DecodeGemv,shapewise full cudagraph+DecodeGemv64" \
  2>&1 | tail -12
echo done
