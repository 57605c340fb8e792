# Sourced by the device scripts (`source benchmarks/device/_setup.sh`, from the repository root): the
# checkout on PYTHONPATH, $OUT (default /tmp/out) made, the deadline clock (`left`: seconds until DEADLINE,
# default ${DEADLINE_DEFAULT:-585} s after the source), and the GPU, torch and transformers written to
# $OUT/gpus.txt; `decode_1b` runs bench_decode's 1B with the time left. At the script's exit everything under $OUT is packed into one file, $OUT/all.tgz
# (`tar xzf all.tgz` here): the device tool brings back at most 8 files, and a run's tables beyond
# them were lost (2026-12-06: bench_llama's profiles). PACK=0 leaves $OUT as it is.
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $(( ${DEADLINE:-${DEADLINE_DEFAULT:-585}} - ($(date +%s) - START) )); }
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/gpus.txt"
# bench_decode on the 1B with the time left (5 s kept), contenders $1, GENERATE_REPEATS generate() repeats (default 1),
# into $OUT/decode (log: bench_decode.log).
decode_1b() {
  local T; T=$(left); echo "left for bench_decode: $T s"
  [ "$T" -gt 60 ] && timeout $(( T - 5 )) python3 benchmarks/bench_decode.py --models 1b --contenders "$1" --rounds 3 \
    --generate-repeats "${GENERATE_REPEATS:-1}" --check-layers "${CHECK_LAYERS:-2}" --out "$OUT/decode" 2>&1 \
    | grep -v "Warn\|warn\|skipping" | tee "$OUT/bench_decode.log" | tail -12
}
# The GPU suite (`make gpu-test`'s selection over TESTS, default every folder) in at most $1 s, 8 workers, two Inductor
# compile threads each, into $OUT/gpu_suite.txt; prints the passes so far and the summary and failure lines.
gpu_suite() {
  TORCHINDUCTOR_COMPILE_THREADS=2 timeout "$1" python3 -m pytest -v -rfE -n 8 -m "(gpu or inductor) and not fuzz" \
    -p no:cacheprovider --durations=25 ${TESTS:-tests} >"$OUT/gpu_suite.txt" 2>&1
  echo "suite rc=$?"; grep -cE " PASSED " "$OUT/gpu_suite.txt" | sed 's/^/passed so far: /'
  grep -E "passed|failed|error|FAILED|ERROR" "$OUT/gpu_suite.txt" | grep -v " PASSED " | tail -30
}
pack_out() {
  [ "${PACK:-1}" = 0 ] && return
  (cd "$OUT" && tar czf /tmp/_sw_all.tgz . && find . -mindepth 1 -delete && mv /tmp/_sw_all.tgz all.tgz)
}
trap pack_out EXIT
