# Sourced by the device scripts (`source benchmarks/device/_setup.sh`, from the repository root): the
# checkout on PYTHONPATH, $OUT (default /tmp/out) made, the deadline clock (`left`: seconds until DEADLINE,
# default ${DEADLINE_DEFAULT:-585} s after the source), and the GPU, torch and transformers written to
# $OUT/gpus.txt.
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $(( ${DEADLINE:-${DEADLINE_DEFAULT:-585}} - ($(date +%s) - START) )); }
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/gpus.txt"
