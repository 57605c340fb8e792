#!/usr/bin/env bash
# Device call (one H100 or H200), issue 29: where the compile workers run. The 1B compile_generate's cold
# starts (each a fresh process, cold_generate.py), alternating: 4 workers confined away from the cores kept
# for the session (the default since 2026-12-07: SHAPEWISE_WORKER_RESERVE=auto), 4 workers on every CPU
# (/0: as before), and the serial start, under one deadline (DEADLINE s). Results under $OUT (all.tgz).
# From the repository root: bash benchmarks/device/session_place.sh
source benchmarks/device/_setup.sh
lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name|NUMA node\(s\))" | tee "$OUT/lscpu.txt"
timeout $(( $(left) - 5 )) python3 benchmarks/device/cold_generate.py --out "$OUT/place" \
  --workers "${ORDER:-4,4/0,1,4,4/0}" --timeout "${START_LIMIT:-150}" 2>&1 | cut -c1-300 | tail -8
echo done
