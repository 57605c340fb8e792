#!/usr/bin/env bash
# Device call (one H100 or H200), issue 29: how the compile workers share the machine with the session. The
# 1B compile_generate's cold starts (each a fresh process, cold_generate.py), in the order ORDER gives
# (cold_generate --workers: W workers, W/T with T Inductor compile threads each; 1: the serial start), under
# one deadline (DEADLINE s). Results under $OUT (all.tgz). From the repository root:
#   ORDER="4,2,4/1,1,4,2,4/1" bash benchmarks/device/session_place.sh
source benchmarks/device/_setup.sh
lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name|NUMA node\(s\))" | tee "$OUT/lscpu.txt"
timeout $(( $(left) - 5 )) python3 benchmarks/device/cold_generate.py --out "$OUT/place" \
  --workers "${ORDER:-4,2,4/1,1,4,2,4/1}" --timeout "${START_LIMIT:-150}" 2>&1 | cut -c1-300 | tail -8
echo done
