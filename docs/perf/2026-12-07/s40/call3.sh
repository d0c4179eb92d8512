#!/usr/bin/env bash
# Fortieth session, call 3 (issue 23): config_for's new choice (moe_grouped.MASK) against the old one at 512-8192
# tokens, command buffers off, each layer's kernels from a profile; the 48B B = 1 TTFT A/B (scripts/gpu/ttft_ab.py, one
# process, 64 experts; as run, the same code was this folder's 2_ttft_mask.py, in git at 412e983); the grouped MoE's
# compiled tests.
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== moe_grouped --mask ($(date -u +%T))"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout -k 10 ${C3_MASK:-150} python3 scripts/gpu/moe_grouped.py \
  --tokens 512,1024,2048,4096,8192 --mask --no-dense --no-phases --json "$OUT/3_moe_grouped_mask.json" 2>&1 \
  | grep -v "Deprecation\|_event_op"
echo "mask rc $?"
echo "== TTFT A/B ($(date -u +%T))"
XLA_PYTHON_CLIENT_MEM_FRACTION=.92 REPS=${C3_REPS:-4} timeout -k 10 ${C3_TTFT:-280} \
  python3 scripts/gpu/ttft_ab.py moe_grouped:MASK 2>&1 | tee "$OUT/3_ttft_mask.log" | grep -v Warning
echo "ttft rc $?"
echo "== compiled tests ($(date -u +%T))"
timeout -k 10 ${C3_KT:-100} python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k moe_grouped \
  > "$OUT/3_ktests.log" 2>&1
echo "ktests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/3_ktests.log" | cut -c1-300 | tail -20
