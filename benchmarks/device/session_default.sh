#!/usr/bin/env bash
# Device call (one H100 or H200), 2026-12-07 evening: the GPU tests (TESTS, default every folder: `make gpu-test`'s
# tests; SUITE_LIMIT s), then compile_generate's cold starts on 4 workers (ORDER, cold_generate.py's entries), each
# with a torch.profiler table of one generate() of 32 tokens: the default under full graphs (the prompt trace split
# at SDPA, the decode trace whole) against every trace whole (+none), why the whole program's generate() ran 2.59
# ms a token against 1.62 split on this morning's H100, and keep_cache's effect (+none:keep, +default:keep: one
# static cache kept from call to call). One deadline (DEADLINE s); results under $OUT (all.tgz). From the root:
#   DEADLINE=585 SUITE_LIMIT=330 ORDER="4,4+none:keep" CHILD_TIMEOUT=120 bash benchmarks/device/session_default.sh
source benchmarks/device/_setup.sh
gpu_suite "${SUITE_LIMIT:-330}"
timeout $(( $(left) - 5 )) python3 benchmarks/device/cold_generate.py --out "$OUT/cold" --workers "${ORDER:-4,4+none}" \
  --timeout "${CHILD_TIMEOUT:-80}" --torch-profile 2>&1 | cut -c1-300 | tail -4
echo done
