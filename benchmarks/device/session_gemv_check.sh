#!/usr/bin/env bash
# Device call (short): the library's GPU tests with every failure named, then bench_llama's 7B-sized stack at
# 1/8/64 tokens with DecodeGemv (16 rows, as before this session; 64-row tiles; the GLU rewrite) beside the
# full graph, to say which change made 2026-12-05 (late)'s DecodeGemv64 contenders 2.4x slower. Under DEADLINE s.
source benchmarks/device/_setup.sh
mkdir -p "$OUT/llama"
timeout "${TEST_LIMIT:-170}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/library -n 4 -rf --tb=line 2>&1 \
  | grep -v "Warn\|warn" | tail -30 | tee "$OUT/gpu_library.txt"
T=$(left); echo "left for bench_llama: $T s"
[ "$T" -gt 30 ] && timeout $(( T - 3 )) python3 benchmarks/bench_llama.py --out "$OUT/llama" --repeats 2 \
  --tokens 1,8,64 --contenders "shapewise static+full cudagraph,shapewise full cudagraph+DecodeGemv,shapewise full cudagraph+DecodeGemv+GLU,shapewise full cudagraph+DecodeGemv64" \
  2>&1 | grep -v "Warn\|warn" | tee "$OUT/llama/log.txt" | grep "T=\|FAILED" | tail -16
echo done
