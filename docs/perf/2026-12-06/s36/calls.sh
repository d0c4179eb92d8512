# thirty-sixth session, 2026-12-06/07, 1x NVIDIA H200 (calls 1-4 on one warm machine; calls 5-6 on a 1x H100 80GB HBM3,
# 788b2b3's code: the gated-norm GEMV's tiling knobs), jax/jaxlib 0.11.2, CUDA 13,
# Python 3.12.3 (the device image), main at 85333db (the model's code is d672b2b's, the thirty-fifth session's
# last: this session changed tests, CI and docs only). Files start with their call's number; N_printed.txt is call N's printed output.
# Tries: 22:54 `nvidia-h200` + needs_h200 (the 256-expert `bench generate`, 91.5 GB): no machine (91 s). 23:02 the
# same: none. 23:08 refused (none tried). 23:11 none. 23:21 refused. 23:23 this H200 (calls 1-4).
#
# ---- call 1: the script as run (scripts/gpu/s36_call1.sh)
#> #!/usr/bin/env bash
#> # Thirty-sixth session, call 1 (an H200 for the 256 experts, 91.5 GB; on an H100 64 experts): main's figures on this
#> # card: issue 22's `bench generate` B = 1 decode tokens/s (>= 436) and issue 23's TTFT, all experts; the 48B B = 1 step
#> # at 4K and 32K (64 experts, issue 22's 1.35x / 1.45x, <= 250 launches); then (C2_GROUPED=1) the grouped GEMM's split
#> # against bm 64 at 4096 x 8 of 256 (issue 23's 350 TFLOP/s).
#> set -u
#> OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
#> P="$OUT/printed.txt"
#> {
#> OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|H100|H200|rror|build_info|cuda" | head -20
#> export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
#> kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
#> if [[ "$kind" == *H200* ]]; then EXP=256; else EXP=64; fi
#> echo "== GPU: $kind; experts: $EXP ($(date -u +%T))"
#> if [ "${C2_TESTS:-0}" = 1 ]; then
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
#> if [ "${C2_GROUPED:-0}" = 1 ]; then
#>   timeout -k 5 ${C2_GR_T:-80} python3 scripts/gpu/moe_grouped.py --json "$OUT/moe_grouped.json" --tokens 4096 --split \
#>     --no-dense 2>&1 | cut -c1-240
#>   echo "grouped rc ${PIPESTATUS[0]}"
#> fi
#> echo "== done ($(date -u +%T))"
#> } 2>&1 | tee "$P"
#
# ---- call 2: the script as run (scripts/gpu/s36_call2.sh)
#> #!/usr/bin/env bash
#> # Thirty-sixth session, call 2 (warm after call 1, an H200): issue 23's B = 8 TTFT with all 256 experts (<= 1.2 s; last
#> # measured in the sixth session), the grouped GEMM's split against bm 64 at 4096 x 8 of 256 (>= 350 TFLOP/s), K3
#> # layers 11-14 at TP 1 stock against packed at B = 1 and 8 (issue 22's K3 rows), then (C2_KT=1) every kernel's
#> # compiled GPU tests and each kernel against its XLA path at real dims.
#> set -u
#> OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
#> P="$OUT/printed.txt"
#> {
#> python3 -c "import jaxk3._ffi" 2>/dev/null || OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|rror" | head -20
#> export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
#> kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
#> if [[ "$kind" == *H200* ]]; then EXP=256; else EXP=64; fi
#> echo "== GPU: $kind; experts: $EXP ($(date -u +%T))"
#> if [ "${C2_GEN8:-1}" = 1 ]; then
#>   timeout -k 5 ${C2_GEN8_T:-200} python3 -m jaxk3.cli bench generate --config kimi-linear-48b --tp 1 --batch 8 \
#>     --experts $EXP --prompt 4096 --new 64 --json "$OUT/generate_b8.json" 2>&1 | tail -30 | cut -c1-240
#>   echo "generate B=8 rc ${PIPESTATUS[0]} ($(date -u +%T))"
#> fi
#> if [ "${C2_GROUPED:-1}" = 1 ]; then
#>   timeout -k 5 ${C2_GR_T:-80} python3 scripts/gpu/moe_grouped.py --json "$OUT/moe_grouped.json" --tokens 4096 --split \
#>     --no-dense 2>&1 | cut -c1-240
#>   echo "grouped rc ${PIPESTATUS[0]} ($(date -u +%T))"
#> fi
#> if [ "${C2_K3:-1}" = 1 ]; then
#>   echo "== K3 layers 11-14, TP 1, stock vs packed ($(date -u +%T))"
#>   timeout -k 5 ${C2_K3_T:-200} python3 -m jaxk3.cli bench decode --config k3 --layers 11-14 --experts 32 --tp 1 \
#>     --batch 1,8 --context 4k --strategies stock,packed+sharded+one-shot --json "$OUT/k3_tp1.json" 2>&1 \
#>     | grep -E "^ +[18] \||floor|rror" | cut -c1-240
#> fi
#> if [ "${C2_KT:-0}" = 1 ]; then
#>   OUT=$OUT KTEST_TIMEOUT=${C2_KT_T:-300} KTEST_FILES="tests/test_kernels_real.py tests/test_gemv.py tests/test_kernels.py" \
#>     KR_TIMEOUT=${C2_KR_T:-150} bash scripts/gpu_check.sh ktests kreal 2>&1 | cut -c1-240
#> fi
#> echo "== done ($(date -u +%T))"
#> } 2>&1 | tee "$P"
#
# call 1 (wall 261.1 s, fresh machine): C2_GEN_T=290 C2_STEP_T=90 bash scripts/gpu/s36_call1.sh
# call 2 (wall 161.0 s, warm):          C2_GEN8_T=200 C2_GR_T=80 C2_K3_T=200 bash scripts/gpu/s36_call2.sh
# call 3 (wall 47.0 s, warm): the 48B B = 1 step's census (command buffers off; gpu_check.sh's census48 stage)
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92; python3 -c "import jaxk3._ffi" || OUT=/tmp/gc bash scripts/gpu_check.sh env build | tail -3; OUT=$OUT CENSUS_TIMEOUT=200 bash scripts/gpu_check.sh census48 2>&1 | grep -v "^  \.\." | cut -c1-260 | head -60
# call 4 (wall 442.8 s, warm; both stages stopped at their limits, rc 124):
#   C2_GEN8=0 C2_GROUPED=0 C2_K3=0 C2_KT=1 C2_KT_T=290 C2_KR_T=150 bash scripts/gpu/s36_call2.sh
#
# Tries after call 4: 00:03 `nvidia-h200` (no needs_h200): none (180 s). 00:04 and 00:14 `nvidia-h100-x1`: refused
# (none tried). 00:15 `nvidia-h100-x1`: an H100 80GB HBM3 (calls 5, 6), with 349 s of the session's device time left.
# ---- call 5 (wall 49.7 s, fresh H100): the gated-norm o_proj's tilings alone (scripts/gpu/s36_call3.sh, no A/B)
#   C3_AB=0 C3_SW_T=100 bash scripts/gpu/s36_call3.sh
# ---- call 6 (wall 211.3 s, warm): the sweep's fastest tiling in the 48B B = 1 step, main / it / main. Every process
#   ran past its 70 s limit (a fresh machine's random weights, copy bandwidth and compile take ~75-90 s): no rows.
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92; mkdir -p $OUT/ab; OUT=$OUT/ab AGAIN=1 S_TIMEOUT=70 AB="gemv:GNORM_SPLITS=2+gemv:GNORM_BN=16+gemv:GNORM_WARPS=4@1" bash scripts/gpu/ab_call.sh 2>&1 | cut -c1-200 | tee $OUT/printed.txt
# ---- scripts/gpu/s36_call3.sh as run (calls 5-6):
#> #!/usr/bin/env bash
#> # Thirty-sixth session, calls 5-6: KDA's o_proj with the gated norm in its prologue (`gemv_gnorm`, 8.26 us in the H200's
#> # census for 18.9 MB, 2.3 TB/s) against XLA's plain GEMV of the same weight (the MLA o_proj's 6.74 us): its tilings
#> # (scripts/gpu/gnorm_sweep.py), then, if one beats the default by 2%, the 48B B = 1 step with it against main, main
#> # again after (ab_call.sh). Predicted: at XLA's rate ~1.5 us x 20 KDA blocks, ~30 us off the step (1.2%).
#> set -u
#> OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
#> P="$OUT/printed.txt"
#> {
#> python3 -c "import jaxk3._ffi" 2>/dev/null || OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|H100|H200|rror" | head -20
#> export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
#> echo "== GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) ($(date -u +%T))"
#> timeout -k 5 ${C3_SW_T:-120} python3 scripts/gpu/gnorm_sweep.py --json "$OUT/gnorm_sweep.json" 2>&1 | cut -c1-200
#> best=$(python3 -c "import json; print(json.load(open('$OUT/gnorm_sweep.json'))['best'])" 2>/dev/null || echo -)
#> echo "== best: $best ($(date -u +%T))"
#> if [ "$best" != "-" ] && [ "${C3_AB:-1}" = 1 ]; then
#>   OUT=$OUT/ab AGAIN=1 T_TIMEOUT=60 TEST_K="gnorm" S_TIMEOUT=${C3_S_T:-90} AB="$best@1" bash scripts/gpu/ab_call.sh 2>&1 | cut -c1-220
#> fi
#> echo "== done ($(date -u +%T))"
#> } 2>&1 | tee "$P"
