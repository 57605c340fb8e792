#!/usr/bin/env bash
# Device call (one H100 or H200): the one-to-four-row GEMV kernel (``rows``) and PDL chains of the kernel
# (issue 28). Under one deadline (DEADLINE s), each step only with time left: bench_gemv on the 1B's fused
# shapes at 1 row (cuBLAS, the tuned kernel, + PDL; every config in graphs) and a 16-layer chain of them
# (cuBLAS against the kernel, with and without PDL); the library's GPU tests (failures named); bench_decode
# 1b with sw_full_nogemv (cuBLAS at decode), sw_full (DecodeGemv, tuned against cuBLAS: compile_generate's
# default since 2026-12-06) and sw_full_pdl (DecodeGemv(pdl=True): the kernel everywhere, Inductor's kernels
# and the attention with PDL too), the bf16/fp32 checks on. (Before 2026-12-06 the three were sw_full,
# sw_full_gemv, sw_full_gemv_pdl.)
# Results under $OUT. From the repository root: bash benchmarks/device/session_rows.sh
source benchmarks/device/_setup.sh
export SHAPEWISE_GEMV_ROWS=${SHAPEWISE_GEMV_ROWS:-1}  # the rows kernel a candidate (off by default until run here)
timeout "${GEMV_LIMIT:-150}" python3 benchmarks/bench_gemv.py --shapes 1b --rows "${ROWS:-1}" --all-configs \
  --chain 16 --chain-rows "${CHAIN_ROWS:-1}" --repeats 3 --out "$OUT/gemv" 2>&1 | grep -v "Warn\|warn" \
  | tee "$OUT/gemv.log" | grep -v "^  " | tail -12
T=$(left); echo "left for the tests: $T s"
timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/library -n 8 2>&1 \
  | tail -40 | tee "$OUT/gpu_library.txt" | grep -E "passed|failed|FAILED|ERROR|Error" | head -20
decode_1b "${CONTENDERS:-sw_full_nogemv,sw_full,sw_full_pdl}"
echo done
