#!/usr/bin/env bash
# One device call (one H200): the GEMV sweep (Pallas configs vs XLA's dot vs a cupy CUDA ceiling),
# every device kernel at real per-rank dims against its XLA path, and the compiled real-dims tests.
#   bash scripts/gpu/kernels_check.sh [env] [gemv] [kernels] [tests] [gemvtest]   (default: all)
# Environment: GEMV_ARGS (extra gemv_sweep.py arguments), KR_ARGS (kernels_real.py), *_TIMEOUT.
# Logs and JSON under $OUT (default ./out/gpu); the last lines printed are the summary tables.
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
export OUT PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 JAX_PLATFORMS=cuda
PY=${PY:-python3}
STAGES=${*:-env gemv kernels tests}
has() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s]"; }

if has env; then
  { date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
    $PY -c "import jax, jaxlib, triton, cupy; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__, 'cupy', cupy.__version__); print(jax.devices())"
  } 2>&1 | tee "$OUT/env.txt"
fi
if has gemv; then
  echo "== gemv sweep $(el)"
  timeout ${GEMV_TIMEOUT:-240} $PY scripts/gpu/gemv_sweep.py --json "$OUT/gemv.json" ${GEMV_ARGS:-} > "$OUT/gemv.stdout" 2>&1
  echo "gemv rc $?"; grep -E "FAILED" "$OUT/gemv.stdout" | head -20
fi
if has kernels; then
  echo "== kernels at real dims vs XLA $(el)"
  timeout ${KR_TIMEOUT:-150} $PY scripts/gpu/kernels_real.py --json "$OUT/kernels_real.json" ${KR_ARGS:-} > "$OUT/kernels_real.stdout" 2>&1
  echo "kernels_real rc $?"
fi
if has tests; then
  echo "== compiled tests at real dims $(el)"
  timeout ${TEST_TIMEOUT:-150} $PY -m pytest tests/test_kernels_real.py tests/test_gemv.py ${TEST_EXTRA:-} -m gpu -q -rfEs -p no:cacheprovider \
    -n ${TEST_PROCS:-6} > "$OUT/tests.log" 2>&1
  echo "tests rc $?"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | cut -c1-300 | tail -30
fi
echo "== summaries $(el)"
[ -f "$OUT/gemv.log" ] && sed -n '/# GEMV summary/,$p' "$OUT/gemv.log"
[ -f "$OUT/kernels_real.log" ] && sed -n '/# kernels vs XLA/,$p' "$OUT/kernels_real.log" | cut -c1-160
echo "== done $(el)"
