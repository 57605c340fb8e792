#!/usr/bin/env bash
# Device call (one H100 or H200), issue 29: the 1B compile_generate's starts, each a fresh process. Under
# one deadline (DEADLINE s): cold (serial, saving the whole program), warm (the whole program loaded) and
# cold with 4 compile workers (the new "auto" on 16 CPUs) (cold_generate.py --warm --kinds whole --parallel 4); then, with time left,
# one more serial/parallel pair (--workers 4,1) for the spread. Each row has its variants' sources and
# seconds in the session (a compile, a load, or the wait for a worker's artifact), and DecodeGemv's tuning
# time. Results under $OUT (packed into all.tgz).
# From the repository root: bash benchmarks/device/session_cold.sh
source benchmarks/device/_setup.sh
timeout $(( $(left) - 5 )) python3 benchmarks/device/cold_generate.py --out "$OUT/warm" --warm --kinds whole \
  --parallel 4 --timeout "${START_LIMIT:-200}" 2>&1 | cut -c1-400 | tail -6
T=$(left); echo "left for a second pair: $T s"
[ "$T" -gt 200 ] && timeout $(( T - 5 )) python3 benchmarks/device/cold_generate.py --out "$OUT/pair" \
  --workers 4,1 --timeout "${START_LIMIT:-200}" 2>&1 | cut -c1-400 | tail -4
echo done
