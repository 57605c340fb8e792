#!/usr/bin/env bash
# Device call (one H100 or H200), issues 28 and 29: the 1B compile_generate split at attention (splitting_ops
# =("sdpa",), a full CUDA graph over the split program) against the whole forward (the GPU's default). First
# the cold starts (cold_generate.py, each a fresh process; ORDER's entries W[+sdpa]: W compile workers, +sdpa
# split), then the decode step of both side by side (bench_decode's sw_full and sw_full_split). One deadline
# (DEADLINE s); results under $OUT (all.tgz). From the repository root: bash benchmarks/device/session_split.sh
source benchmarks/device/_setup.sh
timeout $(( $(left) - ${BENCH_S:-200} )) python3 benchmarks/device/cold_generate.py --out "$OUT/cold" \
  --workers "${ORDER:-1+sdpa:prefill,1,1+sdpa,4+sdpa:prefill}" --timeout "${START_LIMIT:-150}" 2>&1 | cut -c1-400 | tail -8
timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --models 1b --contenders sw_full,sw_full_split,sw_full_glu \
  --rounds 3 --generate-repeats 3 --check-layers 2 --out "$OUT/decode" 2>&1 | grep -v "Warn\|warn\|skipping" | tail -14
echo done
