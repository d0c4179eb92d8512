#!/usr/bin/env bash
# Fortieth session, call 1 (issue 23): kernel 2's tilings, the masked padding and the combine kernel at the 48B's
# prefill dims, each layer's kernels from a profile (scripts/gpu/moe_grouped.py --down); then the grouped MoE's
# compiled tests (the new forms among them).  No build: these kernels need no FFI extension.
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== moe_grouped --down ($(date -u +%T))"
timeout -k 10 ${C1_DOWN:-360} \
  python3 scripts/gpu/moe_grouped.py --tokens 4096 --down --no-dense --no-phases --json "$OUT/1_moe_grouped_down.json"
echo "down rc $?"
echo "== compiled tests ($(date -u +%T))"
timeout -k 10 ${C1_KT:-120} python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k moe_grouped \
  > "$OUT/1_ktests.log" 2>&1
echo "ktests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/1_ktests.log" | cut -c1-300 | tail -20
