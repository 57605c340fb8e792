#!/usr/bin/env bash
# Device call (one H100 or H200), issue 28: DecodeGemv(glu=True) with its timing (kernels.gemv.glu_pays: the down
# projection's kernel computes silu(gate) * up only where that beats the plain product and the activation's kernel)
# against DecodeGemv alone: bench_llama's 7B-sized stack at TOKENS, profiled, in one process. One deadline
# (DEADLINE s); results under $OUT (all.tgz). From the repository root: bash benchmarks/device/session_glu.sh
source benchmarks/device/_setup.sh
timeout $(( $(left) - 5 )) python3 benchmarks/bench_llama.py --out "$OUT/llama" --repeats 3 --tokens "${TOKENS:-1,8,64}" \
  --profile --contenders "shapewise full cudagraph+DecodeGemv64,shapewise full cudagraph+DecodeGemv64+GLU" 2>&1 | tail -10
python3 -c "import json; print(json.load(open('$OUT/llama/results.json'))['env'].get('glu_decisions'))"
echo done
