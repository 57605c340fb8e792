# Sourced by the device scripts (`source benchmarks/device/_setup.sh`, from the repository root): the
# checkout on PYTHONPATH, $OUT (default /tmp/out) made, the deadline clock (`left`: seconds until DEADLINE,
# default ${DEADLINE_DEFAULT:-585} s after the source), and the GPU, torch and transformers written to
# $OUT/gpus.txt. At the script's exit everything under $OUT is packed into one file, $OUT/all.tgz
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
pack_out() {
  [ "${PACK:-1}" = 0 ] && return
  (cd "$OUT" && tar czf /tmp/_sw_all.tgz . && find . -mindepth 1 -delete && mv /tmp/_sw_all.tgz all.tgz)
}
trap pack_out EXIT
