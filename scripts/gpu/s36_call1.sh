#!/usr/bin/env bash
# Thirty-sixth session, call 1 (an H200 for the 256 experts, 91.5 GB; on an H100 64 experts): main's figures on this
# card: issue 22's `bench generate` B = 1 decode tokens/s (>= 436) and issue 23's TTFT, all experts; the 48B B = 1 step
# at 4K and 32K (64 experts, issue 22's 1.35x / 1.45x, <= 250 launches); then (C2_GROUPED=1) the grouped GEMM's split
# against bm 64 at 4096 x 8 of 256 (issue 23's 350 TFLOP/s).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="$OUT/printed.txt"
{
OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|H100|H200|rror|build_info|cuda" | head -20
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [[ "$kind" == *H200* ]]; then EXP=256; else EXP=64; fi
echo "== GPU: $kind; experts: $EXP ($(date -u +%T))"
if [ "${C2_TESTS:-0}" = 1 ]; then
  echo "== compiled tests: the fold (kernel 2 adding the residual) ($(date -u +%T))"
  timeout -k 5 ${C2_TESTS_T:-150} python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider \
    -k "residual_in_kernel_2_on_gpu or moe_block_paths_against_float64_on_gpu" > "$OUT/tests.log" 2>&1
  echo "tests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | cut -c1-300 | tail -8
fi
if [ "${C2_GEN:-1}" = 1 ]; then
  timeout -k 5 ${C2_GEN_T:-280} python3 -m jaxk3.cli bench generate --config kimi-linear-48b --tp 1 --batch 1 \
    --experts $EXP --prompt 4096 --new 256 --json "$OUT/generate_b1.json" 2>&1 | tail -40 | cut -c1-240
  echo "generate rc ${PIPESTATUS[0]} ($(date -u +%T))"
fi
S="--config kimi-linear-48b --layers all --experts 64 --tp 1 --batch 1 --strategies stock --variants serving/auto --steps 20 --repeats 5"
for ctx in 4k 32k; do
  [ "${C2_STEP:-1}" = 1 ] || break
  echo "== 48B B = 1, $ctx ($(date -u +%T))"
  timeout -k 5 ${C2_STEP_T:-85} python3 -m jaxk3.cli bench decode $S --context $ctx --json "$OUT/step48_$ctx.json" 2>&1 \
    | grep -E "^ +1 \||floor|rror" | cut -c1-240
done
if [ "${C2_GROUPED:-0}" = 1 ]; then
  timeout -k 5 ${C2_GR_T:-80} python3 scripts/gpu/moe_grouped.py --json "$OUT/moe_grouped.json" --tokens 4096 --split \
    --no-dense 2>&1 | cut -c1-240
  echo "grouped rc ${PIPESTATUS[0]}"
fi
echo "== done ($(date -u +%T))"
} 2>&1 | tee "$P"
