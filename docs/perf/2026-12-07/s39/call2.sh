#!/usr/bin/env bash
# Thirty-ninth session, call 2 (issue 22): kda_decode_out rebuilt with the state in place (a program per (head, value
# columns), the 1/rms after the product), its first GPU run: the compiled tests at the 48B's dims (4 configurations,
# against the two kernels it replaces), its configurations alone against those two kernels (scripts/gpu/kda_out_sweep.py),
# then the 48B B = 1 step: main / with it (the sweep's fastest configuration) / main again (ab_call.sh).
# Predicted: one kernel's fixed cost less per KDA block and o_proj's 18.9 MB streamed by 128 programs at once: the two
# kernels' 19.5 us (H100, call 1) to ~10 us, ~150-200 us off the 48B step, 20 launches fewer (the 1/rms fusion aside).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
python3 -c "import jaxk3._ffi" 2>/dev/null || OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|rror" | head -20
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
echo "== GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) ($(date -u +%T))"
timeout -k 5 ${C6_T_T:-150} python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider \
  -k "kda_decode_out" > "$OUT/ktests.log" 2>&1
echo "tests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" "$OUT/ktests.log" | cut -c1-300 | tail -12
timeout -k 5 ${C6_SW_T:-120} python3 scripts/gpu/kda_out_sweep.py --json "$OUT/kda_out_sweep.json" 2>&1 | cut -c1-200
best=$(python3 -c "import json; print(json.load(open('$OUT/kda_out_sweep.json'))['best'])" 2>/dev/null || echo kda_decode_out)
echo "== step with: $best ($(date -u +%T))"
if [ "${C6_AB:-1}" = 1 ]; then
  OUT=$OUT/ab AGAIN=${C6_AGAIN-1} S_TIMEOUT=${C6_S_T:-110} AB="$best@1" bash scripts/gpu/ab_call.sh 2>&1 | cut -c1-220
fi
echo "== done ($(date -u +%T))"
} 2>&1 | tee "$OUT/printed.txt"
