#!/usr/bin/env bash
# Device call (one H200): bench_decode on the Llama-3.1-8B shapes, transformers' recipe beside
# compile_generate's defaults, under one deadline (DEADLINE s). Results under $OUT.
# Run from the repository root on the device machine: bash benchmarks/device/session_8b.sh
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/gpus.txt"
timeout "${DEADLINE:-470}" python3 benchmarks/bench_decode.py --models 8b --contenders hf_recipe,sw_full \
  --rounds 3 --generate-repeats 2 --check-layers 2 --out "$OUT" 2>&1 | grep -v "Warn\|warn\|skipping" | tail -12
echo "rc=$?"
