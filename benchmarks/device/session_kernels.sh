#!/usr/bin/env bash
# Device call (one H200), under one deadline (DEADLINE s from the start), issue 28's kernel numbers:
# bench_llama's 7B-sized stack at 1-64 tokens (reduce-overhead beside shapewise's full graph with and
# without DecodeGemv: the target is the best shapewise mode <= 1.25x the floor), then with what time is
# left bench_gemv on the fused weight shapes of the 1B and 8B models at 1, 4 and 16 rows, every kernel
# config timed in the graphs beside the tuner's choice and cuBLAS. Results under $OUT.
# Run from the repository root on the device machine: bash benchmarks/device/session_kernels.sh
source benchmarks/device/_setup.sh
mkdir -p "$OUT/llama" "$OUT/gemv"
timeout "${LLAMA_LIMIT:-300}" python3 benchmarks/bench_llama.py --out "$OUT/llama" --repeats 3 --tokens 1,8,64 \
  --contenders "reduce-overhead,shapewise static+full cudagraph,shapewise full cudagraph+DecodeGemv" 2>&1 | tail -12
T=$(left); echo "left for bench_gemv: $T s"
[ "$T" -gt 60 ] && timeout "$T" python3 benchmarks/bench_gemv.py --out "$OUT/gemv" --shapes 1b,8b --rows 1,4,16 \
  --all-configs --repeats 3 2>&1 | grep -v "^  n" | tail -30
echo done
