#!/usr/bin/env bash
# Device call (one H100 or H200), issue 28. Written for the rows kernel at 5-8 rows (row tile 8, cbef08a, run on
# 2026-12-06: benchmarks/results/session_20261206b/4_rows8; reverted in aee2014: today it measures 5-8 rows tuned
# at the tile of 16, the baseline for the next try at those rows). Under one deadline
# (DEADLINE s): the library's GPU tests (TEST_LIMIT s), then bench_llama's 7B-sized stack at 1/5/8/16 tokens,
# static+full against DecodeGemv, profiled (each kernel's GPU µs per forward in llama/results.json).
# Results under $OUT (packed into all.tgz). From the repository root: bash benchmarks/device/session_rows8.sh
source benchmarks/device/_setup.sh
timeout "${TEST_LIMIT:-280}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu -n "${WORKERS:-4}" \
  ${TESTS:-tests/library} 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt" | grep -E "passed|failed|FAILED|ERROR|Fatal" | head -20
T=$(left); echo "left for bench_llama: $T s"
[ "$T" -gt 60 ] && mkdir -p "$OUT/llama" && timeout $(( T - 5 )) python3 benchmarks/bench_llama.py \
  --out "$OUT/llama" --repeats 3 --tokens "${TOKENS:-1,5,8,16}" --profile \
  --contenders "${LLAMA_CONTENDERS:-shapewise static+full cudagraph,shapewise full cudagraph+DecodeGemv}" \
  2>&1 | tail -14
echo done
