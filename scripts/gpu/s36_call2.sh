#!/usr/bin/env bash
# Thirty-sixth session, call 2 (warm after call 1, an H200): issue 23's B = 8 TTFT with all 256 experts (<= 1.2 s; last
# measured in the sixth session), the grouped GEMM's split against bm 64 at 4096 x 8 of 256 (>= 350 TFLOP/s), K3
# layers 11-14 at TP 1 stock against packed at B = 1 and 8 (issue 22's K3 rows), then (C2_KT=1) every kernel's
# compiled GPU tests and each kernel against its XLA path at real dims.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="$OUT/printed.txt"
{
python3 -c "import jaxk3._ffi" 2>/dev/null || OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|rror" | head -20
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [[ "$kind" == *H200* ]]; then EXP=256; else EXP=64; fi
echo "== GPU: $kind; experts: $EXP ($(date -u +%T))"
if [ "${C2_GEN8:-1}" = 1 ]; then
  timeout -k 5 ${C2_GEN8_T:-200} python3 -m jaxk3.cli bench generate --config kimi-linear-48b --tp 1 --batch 8 \
    --experts $EXP --prompt 4096 --new 64 --json "$OUT/generate_b8.json" 2>&1 | tail -30 | cut -c1-240
  echo "generate B=8 rc ${PIPESTATUS[0]} ($(date -u +%T))"
fi
if [ "${C2_GROUPED:-1}" = 1 ]; then
  timeout -k 5 ${C2_GR_T:-80} python3 scripts/gpu/moe_grouped.py --json "$OUT/moe_grouped.json" --tokens 4096 --split \
    --no-dense 2>&1 | cut -c1-240
  echo "grouped rc ${PIPESTATUS[0]} ($(date -u +%T))"
fi
if [ "${C2_K3:-1}" = 1 ]; then
  echo "== K3 layers 11-14, TP 1, stock vs packed ($(date -u +%T))"
  timeout -k 5 ${C2_K3_T:-200} python3 -m jaxk3.cli bench decode --config k3 --layers 11-14 --experts 32 --tp 1 \
    --batch 1,8 --context 4k --strategies stock,packed+sharded+one-shot --json "$OUT/k3_tp1.json" 2>&1 \
    | grep -E "^ +[18] \||floor|rror" | cut -c1-240
fi
if [ "${C2_KT:-0}" = 1 ]; then
  OUT=$OUT KTEST_TIMEOUT=${C2_KT_T:-300} KTEST_FILES="tests/test_kernels_real.py tests/test_gemv.py tests/test_kernels.py" \
    KR_TIMEOUT=${C2_KR_T:-150} bash scripts/gpu_check.sh ktests kreal 2>&1 | cut -c1-240
fi
echo "== done ($(date -u +%T))"
} 2>&1 | tee "$P"
