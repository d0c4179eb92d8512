# thirty-fifth session, 2026-12-06, 1x H100 80GB HBM3 (calls 1-2 on one warm machine), jax/jaxlib 0.11.2, Python 3.12
# (the device image). Files start with their call's number; N_printed.txt is call N's printed output. Calls 1-2 ran
# 9add070's code (moe_experts.RESIDUAL_IN_DOWN built, off by default; the A/B patches it on) with the untracked
# scripts below.
# Tries: 19:16 `nvidia-h200` + needs_h200: no machine (91 s). 19:28 the same: none. 19:29 `nvidia-h100-x1`: none.
# 19:34 no kind: this H100 (calls 1, 2).
#
# ---- call 1 (wall 270.5 s): bash scripts/gpu/s35_call1.sh
#> #!/usr/bin/env bash
#> # Thirty-fifth session, call 1: build; kernel 2 of the MoE experts adding the residual stream itself
#> # (moe_experts.RESIDUAL_IN_DOWN: the 48B B = 1 step 262 -> 237 launches as compiled for an H200 offline): its compiled
#> # tests at the 48B's dims, then the 48B B = 1 step at 4K, main / the fold (4-row programs, I in one 1024-wide tile) /
#> # the fold with 256-wide tiles / the fold with 8-row programs / main again, each in its own process.
#> # Predicted: 25 XLA fusions of ~1.5 us gone, ~35 us (1.2%) off the step, if kernel 2 in one part is as fast as in 4.
#> set -u
#> OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
#> P="$OUT/printed.txt"
#> {
#> OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|H100|H200|rror|build_info|cuda" | head -20
#> echo "== GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) ($(date -u +%T))"
#> OUT=$OUT/ab T_TIMEOUT=${C1_T:-200} TEST_K="residual_in_kernel_2_on_gpu or moe_block_paths_against_float64_on_gpu" \
#>   AGAIN=1 AB="moe_experts:RESIDUAL_IN_DOWN=1@1 moe_experts:RESIDUAL_IN_DOWN=1+moe_experts:FOLD_BK=256@1 moe_experts:RESIDUAL_IN_DOWN=1+moe_experts:Config.down_bn=8@1" \
#>   bash scripts/gpu/ab_call.sh 2>&1 | cut -c1-240
#> echo "== done ($(date -u +%T))"
#> } 2>&1 | tee "$P"
#
# ---- call 2 (wall 208.6 s, warm): the fold's A/B again (main / fold / main), then the TTFT A/B of the grouped GEMM's
#   split (scripts/gpu/7_ttft_split.py was docs/perf/2026-12-06/s34/7_ttft_split.py, copied over)
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92; mkdir -p $OUT/ab; (OUT=$OUT/ab AGAIN=1 AB="moe_experts:RESIDUAL_IN_DOWN=1@1" bash scripts/gpu/ab_call.sh 2>&1 | cut -c1-200; echo "== TTFT split $(date -u +%T)"; REPS=4 timeout -k 5 200 python3 scripts/gpu/7_ttft_split.py 2>&1 | grep -v Warning | tail -8; echo "== done $(date -u +%T)") 2>&1 | tee $OUT/printed.txt
#
# Tries after call 2: 19:48, 19:59 (refused: none tried), 20:19 `nvidia-h200` + needs_h200: none. 20:20 `nvidia-h100-x1`,
# 20:28 no kind, 20:29 and 20:38 `nvidia-h100-x1`: refused (none tried) or none. 20:40 `nvidia-h200` without
# needs_h200: an H100 (call 3).
# ---- call 3 (wall 309.3 s, fresh machine, c317c28's code): C2_GEN_T=170 C2_GR_T=60 C2_STEP_T=75 bash scripts/gpu/s35_call2.sh
#> #!/usr/bin/env bash
#> # Thirty-fifth session, the last call (an H200 for the 256 experts, 91.5 GB; on an H100 64 experts): the fold's
#> # compiled tests after the review's changes; issue 22's `bench generate` B = 1 decode
#> # tokens/s (>= 436) and issue 23's TTFT at main, all experts; the 48B B = 1 step at 4K and 32K (64 experts, issue 22's
#> # 1.35x / 1.45x and <= 250 launches); then the grouped GEMM's split against bm 64 at 4096 x 8 of 256 (issue 23's
#> # 350 TFLOP/s) on this card.
#> set -u
#> OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
#> P="$OUT/printed.txt"
#> {
#> OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|H100|H200|rror|build_info|cuda" | head -20
#> export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
#> kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
#> if [[ "$kind" == *H200* ]]; then EXP=256; else EXP=64; fi
#> echo "== GPU: $kind; experts: $EXP ($(date -u +%T))"
#> if [ "${C2_TESTS:-1}" = 1 ]; then
#>   echo "== compiled tests: the fold (kernel 2 adding the residual) ($(date -u +%T))"
#>   timeout -k 5 ${C2_TESTS_T:-150} python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider \
#>     -k "residual_in_kernel_2_on_gpu or moe_block_paths_against_float64_on_gpu" > "$OUT/tests.log" 2>&1
#>   echo "tests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | cut -c1-300 | tail -8
#> fi
#> if [ "${C2_GEN:-1}" = 1 ]; then
#>   timeout -k 5 ${C2_GEN_T:-280} python3 -m jaxk3.cli bench generate --config kimi-linear-48b --tp 1 --batch 1 \
#>     --experts $EXP --prompt 4096 --new 256 --json "$OUT/generate_b1.json" 2>&1 | tail -40 | cut -c1-240
#>   echo "generate rc ${PIPESTATUS[0]} ($(date -u +%T))"
#> fi
#> S="--config kimi-linear-48b --layers all --experts 64 --tp 1 --batch 1 --strategies stock --variants serving/auto --steps 20 --repeats 5"
#> for ctx in 4k 32k; do
#>   [ "${C2_STEP:-1}" = 1 ] || break
#>   echo "== 48B B = 1, $ctx ($(date -u +%T))"
#>   timeout -k 5 ${C2_STEP_T:-85} python3 -m jaxk3.cli bench decode $S --context $ctx --json "$OUT/step48_$ctx.json" 2>&1 \
#>     | grep -E "^ +1 \||floor|rror" | cut -c1-240
#> done
#> if [ "${C2_GROUPED:-1}" = 1 ]; then
#>   timeout -k 5 ${C2_GR_T:-80} python3 scripts/gpu/moe_grouped.py --json "$OUT/moe_grouped.json" --tokens 4096 --split \
#>     --no-dense 2>&1 | cut -c1-240
#>   echo "grouped rc ${PIPESTATUS[0]}"
#> fi
#> echo "== done ($(date -u +%T))"
#> } 2>&1 | tee "$P"
