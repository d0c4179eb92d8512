#!/usr/bin/env bash
# One device call (one H200): the GEMV sweep (Pallas configs vs XLA's dot vs a cupy CUDA ceiling),
# every device kernel at real per-rank dims against its XLA path, and the compiled real-dims tests.
#   bash scripts/gpu/kernels_check.sh [env] [gemv] [gemvpick] [gemv8] [kernels] [tests]
#   (default: env gemv kernels tests; gemvpick: XLA vs the tuned config per shape only; gemv8: the B = 8
#   sweep of the shapes where the first config lost)
# Environment: GEMV_ARGS, KR_ARGS, TEST_K (pytest -k), *_TIMEOUT.  Logs and JSON go to $LOGS
# (default /tmp/kc_logs) and are packed into $OUT/logs.tgz; the last lines printed are the summaries.
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/gpu}
LOGS=${LOGS:-/tmp/kc_logs}
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 JAX_PLATFORMS=cuda
PY=${PY:-python3}
STAGES=${*:-env gemv kernels tests}
has() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s]"; }

if has env; then
  { date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
    $PY -c "import jax, jaxlib, triton, cupy; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__, 'cupy', cupy.__version__); print(jax.devices())"
  } 2>&1 | tee "$LOGS/env.txt"
fi
if has gemv; then
  echo "== gemv sweep $(el)"
  timeout -k 10 ${GEMV_TIMEOUT:-240} $PY scripts/gpu/gemv_sweep.py --json "$LOGS/gemv.json" ${GEMV_ARGS:-} > "$LOGS/gemv.stdout" 2>&1
  echo "gemv rc $?"; grep -E "FAILED" "$LOGS/gemv.stdout" | head -20
fi
if has gemvpick; then
  echo "== gemv: XLA vs the tuned config, every shape $(el)"
  timeout -k 10 ${PICK_TIMEOUT:-90} $PY scripts/gpu/gemv_sweep.py --only pick --no-cuda --json "$LOGS/gemv_pick.json" > "$LOGS/gemv_pick.stdout" 2>&1
  echo "gemvpick rc $?"
fi
if has gemv8; then
  echo "== gemv: B = 8 sweep $(el)"
  timeout -k 10 ${G8_TIMEOUT:-90} $PY scripts/gpu/gemv_sweep.py --cases kl_gateup,kl_oproj,k3_qa --batch 8 --no-cuda \
    --budget 60 --json "$LOGS/gemv8.json" > "$LOGS/gemv8.stdout" 2>&1
  echo "gemv8 rc $?"
fi
if has kernels; then
  echo "== kernels at real dims vs XLA $(el)"
  timeout -k 10 ${KR_TIMEOUT:-150} $PY scripts/gpu/kernels_real.py --json "$LOGS/kernels_real.json" ${KR_ARGS:-} > "$LOGS/kernels_real.stdout" 2>&1
  echo "kernels_real rc $?"
fi
if has tests; then
  echo "== compiled tests at real dims $(el)"
  timeout -k 10 ${TEST_TIMEOUT:-150} $PY -m pytest tests/test_kernels_real.py tests/test_gemv.py -k "${TEST_K:-gpu}" -m gpu -q -rfEs \
    -p no:cacheprovider -n ${TEST_PROCS:-6} > "$LOGS/tests.log" 2>&1
  echo "tests rc $?"
  grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/tests.log" | cut -c1-300 | tail -30
fi
echo "== summaries $(el)"
for f in gemv gemv_pick gemv8; do
  [ -f "$LOGS/$f.log" ] && sed -n '/# GEMV summary/,$p' "$LOGS/$f.log"
done
[ -f "$LOGS/kernels_real.log" ] && grep "fp32-precision" "$LOGS/kernels_real.log" | sort | uniq -c | head
[ -f "$LOGS/kernels_real.log" ] && sed -n '/# kernels vs XLA/,$p' "$LOGS/kernels_real.log" | cut -c1-150
tar -czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
echo "== done $(el)"
