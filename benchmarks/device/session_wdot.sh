#!/usr/bin/env bash
# Device call (one H100 or H200), issue 28: DecodeGemv's wdot configs (the weight as wgmma's M side). Under one
# deadline (DEADLINE s), each step only with time left: the kernel's GPU tests (every config against float64,
# wdot's included; TEST_LIMIT s); bench_llama's 7B-sized stack at TOKENS, profiled, static+full against
# DecodeGemv64 (wdot timed by the tuner beside dot: the default since 2026-12-07); the same DecodeGemv64
# without it (the A/B on one machine); then bench_gemv on the 7B weights with every config timed in graphs. Results under
# $OUT (packed into all.tgz). From the repository root: bash benchmarks/device/session_wdot.sh
# SUITE=1: the whole GPU suite (`make gpu-test`'s markers, 8 workers, 2 Inductor threads each) in TEST_LIMIT s
# instead of the kernel's tests, then bench_llama with the time left.
source benchmarks/device/_setup.sh
if [ "${SUITE:-0}" = 1 ]; then
  TORCHINDUCTOR_COMPILE_THREADS=2 timeout "${TEST_LIMIT:-340}" python3 -m pytest -v -rfE -n 8 -m "(gpu or inductor) and not fuzz" \
    -p no:cacheprovider --durations=15 tests >"$OUT/gpu_suite.txt" 2>&1
  echo "suite rc=$?"; grep -cE " PASSED " "$OUT/gpu_suite.txt" | sed 's/^/passed: /'
  grep -E "passed|failed|FAILED|ERROR|Fatal" "$OUT/gpu_suite.txt" | grep -v " PASSED " | tail -15
else
  [ "${TEST_LIMIT:-110}" -gt 0 ] && timeout "${TEST_LIMIT:-110}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
    -n "${WORKERS:-4}" ${TESTS:-tests/library/test_decode_gemv.py} 2>&1 | tail -30 \
    | tee "$OUT/gpu_tests.txt" | grep -E "passed|failed|FAILED|ERROR|Error|Fatal" | head -20
fi
llama() {  # $1: folder, $2: contenders; the rest of the environment as given
  T=$(left); echo "left for bench_llama $1: $T s"
  [ "$T" -gt 90 ] && mkdir -p "$OUT/$1" && timeout $(( T - 5 - ${RESERVE:-0} )) python3 benchmarks/bench_llama.py \
    --out "$OUT/$1" --repeats 3 --tokens "${TOKENS:-1,5,8,16,64}" --profile --contenders "$2" 2>&1 | tail -12
}
SHAPEWISE_GEMV_WDOT=1 RESERVE=${AB_RESERVE:-150} llama llama "${LLAMA_CONTENDERS:-shapewise static+full cudagraph,shapewise full cudagraph+DecodeGemv64}"
SHAPEWISE_GEMV_WDOT=0 RESERVE=${GEMV_RESERVE:-60} llama llama_nowdot "shapewise full cudagraph+DecodeGemv64"
T=$(left); echo "left for bench_gemv: $T s"
[ "$T" -gt 40 ] && SHAPEWISE_GEMV_WDOT=1 timeout $(( T - 5 )) python3 benchmarks/bench_gemv.py --out "$OUT/gemv" --shapes 7b \
  --rows "${GEMV_ROWS:-8,64}" --repeats 3 --all-configs 2>&1 | grep -E "^\[|best config" | tail -16
echo done
