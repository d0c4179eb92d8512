#!/usr/bin/env bash
# Fortieth session, call 1 (issue 23): build; the grouped MoE's compiled tests (the masked padding and kernel 2's own
# tiling among them); then kernel 2's tilings and the masked padding at the 48B's prefill dims, each layer's kernels
# from a profile (scripts/gpu/moe_grouped.py --down).
set -u
OUT=${OUT:-out/gpu}
KTEST_FILES=tests/test_kernels.py KTEST_K=moe_grouped KTEST_TIMEOUT=${C1_KT:-150} OUT=$OUT \
  bash scripts/gpu_check.sh env build ktests
echo "== moe_grouped --down ($(date -u +%T))"
JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 10 ${C1_DOWN:-330} \
  python3 scripts/gpu/moe_grouped.py --tokens 4096 --down --no-dense --no-phases --json "$OUT/1_moe_grouped_down.json"
echo "down rc $?"
