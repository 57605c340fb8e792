#!/usr/bin/env bash
# Device call (one H100 or H200): the GEMV tuner timing in CUDA graphs over weight copies (issue 28).
# Under one deadline (DEADLINE s): the library's GPU tests (failures named); bench_decode 1b with
# sw_full_nogemv (cuBLAS at decode) and sw_full (DecodeGemv by default), the checks on; bench_gemv on
# the 1B's fused shapes at 1 row (cuBLAS against the tuned kernel) and its 16-layer chain.
# Results under $OUT. From the repository root: bash benchmarks/device/session_tune_graphs.sh
source benchmarks/device/_setup.sh
timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/library -n "${WORKERS:-8}" \
  2>&1 | tail -40 | tee "$OUT/gpu_library.txt" | grep -E "passed|failed|FAILED|ERROR|Error" | head -20
T=$(left); echo "left for bench_decode: $T s"
[ "$T" -gt 60 ] && timeout $(( T < ${DECODE_LIMIT:-180} ? T - 5 : ${DECODE_LIMIT:-180} )) python3 \
  benchmarks/bench_decode.py --models 1b --contenders "${CONTENDERS:-sw_full_nogemv,sw_full}" --rounds 3 \
  --generate-repeats 1 --check-layers "${CHECK_LAYERS:-2}" --out "$OUT/decode" 2>&1 \
  | grep -v "Warn\|warn\|skipping" | tee "$OUT/bench_decode.log" | tail -8
T=$(left); echo "left for bench_gemv: $T s"
[ "$T" -gt 30 ] && timeout $(( T - 3 )) python3 benchmarks/bench_gemv.py --shapes 1b --rows 1 --chain 16 \
  --chain-rows 1 --repeats 3 --out "$OUT/gemv" 2>&1 | grep -v "Warn\|warn" | tee "$OUT/gemv.log" | grep -v "^  " | tail -14
echo done
