#!/usr/bin/env bash
# Device call (one H100 or H200), 2026-12-07 evening: compile_generate's new default under full graphs (the
# prompt trace split at SDPA, the decode trace whole) against every trace whole (+none), each a cold start on 4
# workers with a torch.profiler table of one generate() of 32 tokens (why the whole program's generate() ran
# 2.59 ms a token against 1.62 split on this morning's H100; ORDER="4,4+none,4+none:keep,4+default:keep":
# keep_cache's effect, one static cache kept from call to call), then the GPU suite (`make gpu-test`'s tests) in
# what is left. One deadline (DEADLINE s); results under $OUT (all.tgz). From the repository root:
#   DEADLINE=585 bash benchmarks/device/session_default.sh
source benchmarks/device/_setup.sh
timeout ${COLD_LIMIT:-200} python3 benchmarks/device/cold_generate.py --out "$OUT/cold" --workers "${ORDER:-4,4+none}" \
  --timeout 80 --torch-profile 2>&1 | cut -c1-300 | tail -4
export TORCHINDUCTOR_COMPILE_THREADS=2
timeout $(( $(left) - 8 )) python3 -m pytest -v -rfE -n 8 -m "(gpu or inductor) and not fuzz" -p no:cacheprovider \
  --durations=25 tests >"$OUT/gpu_suite.txt" 2>&1
echo "suite rc=$?"; grep -cE " PASSED " "$OUT/gpu_suite.txt" | sed 's/^/passed so far: /'
grep -E "passed|failed|error|FAILED|ERROR" "$OUT/gpu_suite.txt" | grep -v " PASSED " | tail -30
