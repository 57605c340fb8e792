#!/usr/bin/env bash
# Device call (one H200), under one deadline (DEADLINE s from the start): the whole GPU suite
# (`make gpu-test`, 4 xdist workers); bench_decode 1b with transformers' recipe beside compile_generate's
# default; with what time is left, the 1B compile_generate cold start one variant after another against
# 6 compile workers, then shapewise's decode attention kernel per slice count. Results under $OUT.
# Run from the repository root on the device machine: bash benchmarks/device/session_final.sh
source benchmarks/device/_setup.sh
N=""
python3 -c "import xdist" 2>/dev/null && N="-n ${WORKERS:-4}"
timeout "${SUITE_LIMIT:-420}" python3 -m pytest -q -rfE $N -m "(gpu or inductor) and not fuzz" -p no:cacheprovider \
  --durations=25 tests >"$OUT/gpu_suite.txt" 2>&1
echo "suite rc=$?" | tee -a "$OUT/gpu_suite.txt"
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_suite.txt" | tail -25
T=$(left); echo "left for the bench: $T s"
[ "$T" -gt 60 ] && timeout "$T" python3 benchmarks/bench_decode.py --models 1b --contenders hf_recipe,sw_full \
  --rounds 3 --generate-repeats 3 --check-layers 2 --out "$OUT" 2>&1 | grep -v "Warn\|warn\|skipping" | tail -8
T=$(left); echo "left for the cold start: $T s"
[ "$T" -gt 70 ] && timeout "$T" python3 benchmarks/device/cold_generate.py --out "$OUT" --workers 1,6 \
  --timeout $(( T / 2 - 3 )) 2>&1 | tail -3
T=$(left); echo "left for the kernel plans: $T s"
[ "$T" -gt 25 ] && timeout "$T" python3 benchmarks/device/decode_attention_plans.py --out "$OUT" 2>&1 | tail -6
echo done
