#!/usr/bin/env bash
# Device call (one H100 or H200), 2026-12-07 evening, under one deadline (DEADLINE s), each step only with time
# left: the GPU tests of TESTS (default tests/lower tests/models: the compile workers' task change; TEST_LIMIT s);
# one cold start of compile_generate's default on 4 workers (COLD, cold_generate.py's entries: worker_starts_s
# shows whether the workers were started again); issue 28's experiment at 64 tokens: bench_llama's 7B stack with
# DecodeGemv64 with SHAPEWISE_GEMV_WDOT_MORE=1 (six more wdot tilings timed) against without (A/B on one
# machine), then bench_gemv on the 7B weights at 64 rows with every config. Results under $OUT (all.tgz).
#   DEADLINE=585 bash benchmarks/device/session_more.sh
#   DEADLINE=400 TEST_LIMIT=0 COLD= bash benchmarks/device/session_more.sh   # the 64-row A/B alone
source benchmarks/device/_setup.sh
if [ "${TEST_LIMIT:-200}" -gt 0 ]; then  # (TEST_LIMIT=0: no tests)
  TORCHINDUCTOR_COMPILE_THREADS=2 timeout "${TEST_LIMIT:-200}" python3 -m pytest -v -rfE -n 8 \
    -m "(gpu or inductor) and not fuzz" -p no:cacheprovider --durations=15 ${TESTS:-tests/lower tests/models} \
    >"$OUT/gpu_tests.txt" 2>&1
  echo "tests rc=$?"; grep -cE " PASSED " "$OUT/gpu_tests.txt" | sed 's/^/passed: /'
  grep -E "passed|failed|FAILED|ERROR|Fatal" "$OUT/gpu_tests.txt" | grep -v " PASSED " | tail -15
fi
if [ -n "${COLD-4}" ]; then
  timeout $(( $(left) > 150 ? 150 : $(left) - 5 )) python3 benchmarks/device/cold_generate.py --out "$OUT/cold" \
    --workers "${COLD:-4}" --timeout 140 2>&1 | cut -c1-400 | tail -3
fi
llama() {  # $1: folder; the environment as given
  T=$(left); echo "left for bench_llama $1: $T s"
  [ "$T" -gt 60 ] && mkdir -p "$OUT/$1" && timeout $(( T - 5 - ${RESERVE:-0} )) python3 benchmarks/bench_llama.py \
    --out "$OUT/$1" --repeats 3 --tokens "${TOKENS:-16,64}" --profile \
    --contenders "shapewise full cudagraph+DecodeGemv64" 2>&1 | tail -6
}
SHAPEWISE_GEMV_WDOT_MORE=1 RESERVE=${AB_RESERVE:-110} llama llama_more
RESERVE=${GEMV_RESERVE:-50} llama llama_base
T=$(left); echo "left for bench_gemv: $T s"
[ "$T" -gt 30 ] && SHAPEWISE_GEMV_WDOT_MORE=1 timeout $(( T - 5 )) python3 benchmarks/bench_gemv.py --out "$OUT/gemv" \
  --shapes 7b --rows "${GEMV_ROWS:-64}" --repeats 3 --all-configs 2>&1 | grep -E "^\[|best config" | tail -16
echo done
