#!/usr/bin/env bash
# Thirty-sixth session, calls 5-6: KDA's o_proj with the gated norm in its prologue (`gemv_gnorm`, 8.26 us in the H200's
# census for 18.9 MB, 2.3 TB/s) against XLA's plain GEMV of the same weight (the MLA o_proj's 6.74 us): its tilings
# (scripts/gpu/gnorm_sweep.py), then, if one beats the default by 2%, the 48B B = 1 step with it against main, main
# again after, and with the kernel left out (`-gemv_gnorm`: XLA's norm + dot, which beat every tiling alone in call
# 5's chain on an H100) (ab_call.sh).  C3_TEST_K= leaves the compiled tests out. Predicted: at XLA's rate ~1.5 us x 20 KDA blocks, ~30 us off the step (1.2%).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="$OUT/printed.txt"
{
python3 -c "import jaxk3._ffi" 2>/dev/null || OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|H100|H200|rror" | head -20
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
echo "== GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) ($(date -u +%T))"
timeout -k 5 ${C3_SW_T:-120} python3 scripts/gpu/gnorm_sweep.py --json "$OUT/gnorm_sweep.json" 2>&1 | cut -c1-200
best=$(python3 -c "import json; print(json.load(open('$OUT/gnorm_sweep.json'))['best'])" 2>/dev/null || echo -)
echo "== best: $best ($(date -u +%T))"
ab="-gemv_gnorm@1"; [ "$best" != "-" ] && ab="$best@1 $ab"   # the kernel left out is measured either way
if [ "${C3_AB:-1}" = 1 ]; then
  OUT=$OUT/ab AGAIN=1 T_TIMEOUT=60 TEST_K="${C3_TEST_K-gnorm}" S_TIMEOUT=${C3_S_T:-150} AB="$ab" \
    bash scripts/gpu/ab_call.sh 2>&1 | cut -c1-220
fi
echo "== done ($(date -u +%T))"
} 2>&1 | tee "$P"
