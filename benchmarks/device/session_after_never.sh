#!/usr/bin/env bash
# Device call (one H100 or H200), owed since 2026-12-08: (1) the GPU tests of what changed after that day's GPU suite
# (57161dd: PendingVariant's capture check first, capture_now and Verify loading pending variants; TESTS, default
# tests/lower tests/dispatch tests/passes; TEST_LIMIT s); (2) the 1B's cold start with wait_for_workers="never" and
# with the default, with cold_generate.py's timeline (worker_tasks, dynamo_spans_s: where every-variant-ready goes);
# (3) bench_llama's 7B stack at 64 tokens with a kernel profile (issue 28's last target: per-kernel numbers on this
# GPU). One deadline (DEADLINE s); results under $OUT (all.tgz). From the root:
#   DEADLINE=585 bash benchmarks/device/session_after_never.sh
source benchmarks/device/_setup.sh
if [ "${TEST_LIMIT:-180}" -gt 0 ]; then
  timeout "${TEST_LIMIT:-180}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu -n 8 \
    ${TESTS:-tests/lower tests/dispatch tests/passes} >"$OUT/gpu_tests.txt" 2>&1
  echo "tests rc=$?"; tail -5 "$OUT/gpu_tests.txt"
fi
timeout "${COLD_LIMIT:-200}" python3 benchmarks/device/cold_generate.py --out "$OUT/cold" \
  --workers "${ORDER:-4+default:never,4}" --timeout "${CHILD_TIMEOUT:-100}" 2>&1 | cut -c1-300 | tail -4
T=$(left); echo "left for bench_llama: $T s"
[ "$T" -gt 50 ] && mkdir -p "$OUT/llama" && timeout $(( T - 5 )) python3 benchmarks/bench_llama.py \
  --out "$OUT/llama" --repeats 3 --tokens "${TOKENS:-64}" --profile \
  --contenders "shapewise full cudagraph+DecodeGemv64" 2>&1 | tail -8
echo done
