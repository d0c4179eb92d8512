# thirty-fourth session, 2026-12-06, 1x H100 80GB HBM3 (calls 1-3 on one warm machine, 4-6 on another), jax/jaxlib
# 0.11.2, Python 3.12 (the device image). Files start with their call's number; N_printed.txt is call N's printed
# output. Calls 1-4 ran c2de51f's code (77ce1ea changed tests/test_aot.py only), calls 5-6 fef0ce3's before
# config_for took the split (its Config.down_bm, off by default then), each with the untracked scripts below.
# Tries: 15:57 `nvidia-h200`: no machine (181 s). 16:09 `nvidia-h200` without needs_h200: this H100 (calls 1-3).
# 16:20 and 16:33 needs_h200 (`bench generate` with all 256 experts, 91.5 GB: GEN_TIMEOUT=440 bash scripts/gpu_check.sh
# env build generate): no machine (121 and 90 s). 16:35 `nvidia-h100-x1`: none (90 s). 16:46 no kind: none (180 s).
# 16:58 no kind: an H100 (calls 4-6). 17:07 call 7 (7_ttft_split.py, below) refused: 240 s left, too few to start one.
#
# ---- call 1 (wall 318.5 s): bash scripts/gpu/s34_call1.sh
#> #!/usr/bin/env bash
#> # Thirty-fourth session, call 1: build; issue 22's step figures on whatever GPU came (the 48B B = 1 and 8 at 4K,
#> # B = 1 at 32K, serving/auto; K3 layers 11-14 packed B = 1, main's defaults against the twenty-eighth session's
#> # forms off), then (C1_CHUNKS=1) Model.score(host=False) beside the B = 1 prefill (issue 23).
#> set -u
#> OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
#> P="$OUT/printed.txt"
#> {
#> OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|H100|H200|rror|build_info|cuda" | head -20
#> export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
#> kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
#> if [[ "$kind" == *H200* ]]; then EXP=256; else EXP=64; fi
#> echo "== GPU: $kind; experts for the score: $EXP"
#> if [ "${C1_STEP:-1}" = 1 ]; then
#>   OUT=/tmp/gc STEP_TIMEOUT=${C1_STEP_T:-200} STEP_VARIANTS=serving/auto bash scripts/gpu_check.sh step48 2>&1 | grep -E "^==|^ +[18] \||floor|rror" | cut -c1-240
#>   cp /tmp/gc/step48.json "$OUT/step48.json" 2>/dev/null
#>   echo "== 48B B = 1, 32K ($(date -u +%T))"
#>   timeout -k 5 ${C1_32K_T:-150} python3 -m jaxk3.cli bench decode --config kimi-linear-48b --layers all --experts 64 \
#>     --tp 1 --batch 1 --context 32k --strategies stock --variants serving/auto --steps 20 --repeats 5 \
#>     --json "$OUT/step48_32k.json" 2>&1 | grep -E "^ +1 \||floor|rror" | cut -c1-240
#> fi
#> if [ "${C1_CS:-1}" = 1 ]; then
#>   OUT=/tmp/gc CS_PATCHES='attn_res_norm:SELECT_STACK=0 jaxk3.layers.moe:LATENT_NORM_IN_UP=0' bash scripts/gpu_check.sh cudastep 2>&1 | cut -c1-240
#>   cp /tmp/gc/cudastep_b1_*.json "$OUT/" 2>/dev/null
#> fi
#> if [ "${C1_CHUNKS:-0}" = 1 ]; then
#>   OUT=/tmp/gc CH_TIMEOUT=${C1_CH_T:-240} CH_ARGS="--batches 1 --chunks 1:4096 --experts $EXP" bash scripts/gpu_check.sh chunks 2>&1 | cut -c1-260
#>   cp /tmp/gc/prefill_chunks.json "$OUT/" 2>/dev/null
#> fi
#> echo "== done ($(date -u +%T))"
#> } 2>&1 | tee "$P"
#
# ---- call 2 (wall 121.3 s, warm): C2_NCU_T=200 C2_CH_T=200 bash scripts/gpu/s34_call2.sh
#   (its ncu pass failed at once: `--metrics` given twice; the chunks stage ran: 2_printed.txt, 2_prefill_chunks.json)
# ---- (wall 37.4 s, warm) C2_CHUNKS=0 bash scripts/gpu/s34_call2.sh, with the two ncu passes as below: both
#   segfaulted (rc 139) at the first kernel inside an XLA command buffer (not kept)
# ---- call 3 (wall 35.8 s, warm): XLA_FLAGS=--xla_gpu_enable_command_buffer= C2_CHUNKS=0 bash scripts/gpu/s34_call2.sh
#   (now `scripts/gpu_check.sh groupedncu`): 3_ncu_grouped.txt, 3_ncu_gemm.txt
#> #!/usr/bin/env bash
#> # Thirty-fourth session, call 2: Nsight Compute on the prefill's grouped-GEMM kernels (the default config, 48B dims,
#> # 4096 tokens x 8 of 256 experts) and the plain GEMM of the same FLOPs beside them (issue 23: what bounds them, before
#> # another form is built); then (C2_CHUNKS=1) Model.score(host=False) beside the B = 1 prefill.
#> set -u
#> OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
#> P="$OUT/printed.txt"
#> {
#> OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|H100|H200|rror" | head -12
#> export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
#> kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
#> if [[ "$kind" == *H200* ]]; then EXP=256; else EXP=64; fi
#> NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
#> echo "== GPU: $kind; ncu: $NCU ($(date -u +%T))"
#> if [ "${C2_NCU:-1}" = 1 ]; then
#>   # the grouped kernels (launches 1-2 are the reference's call; then the GEMM's, then the default's timed calls),
#>   # then the plain GEMM of the same FLOPs (cuBLAS) in a second pass
#>   ncu_run() {  # $1 kernel regex, $2 skip, $3 count, $4 file
#>     timeout -k 5 ${C2_NCU_T:-150} $NCU --clock-control none --target-processes all -k regex:"$1" --launch-skip $2 --launch-count $3 \
#>       --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section Occupancy \
#>       --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats \
#>       --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
#>       python3 scripts/gpu/moe_grouped.py --json /tmp/gc/ncu_grouped.json --tokens 4096 --no-sweep --no-dense > "$OUT/$4" 2>&1
#>     echo "ncu $1 rc $?"
#>   }
#>   ncu_run "grouped_gate_up|grouped_down" 2 4 ncu_grouped.txt
#>   ncu_run "gemm|Gemm|nvjet|cutlass|xmma" 3 1 ncu_gemm.txt
#>   for f in ncu_grouped.txt ncu_gemm.txt; do
#>   grep -E "^  [A-Za-z_]+.*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Memory Throughput|L2 Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Dynamic Shared|Block Size|Grid Size|Waves Per SM|Issued Warp|pipe_tensor|dram__bytes|lts__t_sector" \
#>     "$OUT/$f" | cut -c1-200 | head -90
#>   grep -E "^  [A-Za-z_]+.*\(|stalled_.*ratio" "$OUT/$f" | awk '/\(/ || $NF+0 > 0.5' | cut -c1-160 | head -40
#>   done
#> fi
#> if [ "${C2_CHUNKS:-1}" = 1 ]; then
#>   OUT=/tmp/gc CH_TIMEOUT=${C2_CH_T:-240} CH_ARGS="--batches 1 --chunks 1:4096 --experts $EXP" bash scripts/gpu_check.sh chunks 2>&1 | cut -c1-260
#>   cp /tmp/gc/prefill_chunks.json "$OUT/" 2>/dev/null
#> fi
#> echo "== done ($(date -u +%T))"
#> } 2>&1 | tee "$P"
#
# ---- call 4 (wall 48.3 s, fresh machine): bash scripts/gpu/s34_call3.sh   (4_printed.txt, 4_ncu_bm128.txt, 4_ncu_pairs.txt)
#   scripts/gpu/s34_pairs_moe_grouped.py was `git show 4fbd9e1:jaxk3/kernels/moe_grouped.py` (the block pairs' kernels)
#   scripts/gpu/s34_call3.sh:
#> #!/usr/bin/env bash
#> # Thirty-fourth session, call 3: Nsight Compute on two other forms of the grouped GEMM (48B dims, 4096 x 8 of 256),
#> # command buffers off: bm 128 on 8 warps (main's code), then the thirty-third session's block pairs (its kernel file,
#> # 4fbd9e1's, copied over this copy's). Do fewer L2 requests per weight byte show as less L2 throughput, and what
#> # bounds them instead?
#> set -u
#> OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
#> P="$OUT/printed.txt"
#> {
#> OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|H100|H200|rror" | head -8
#> export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92 XLA_FLAGS=--xla_gpu_enable_command_buffer=
#> NCU=$(which ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
#> run() {  # $1 form, $2 launches of one call
#>   echo "== ncu: $1 ($(date -u +%T))"
#>   timeout -k 5 ${C3_T:-120} $NCU --clock-control none --target-processes all -k regex:"grouped_" --launch-skip $2 --launch-count $2 \
#>     --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section Occupancy \
#>     --section LaunchStats --section WarpStateStats --section SchedulerStats \
#>     --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
#>     python3 scripts/gpu/s34_grouped_forms.py $1 > "$OUT/ncu_$1.txt" 2>&1
#>   echo "ncu rc $?"
#>   grep -E "^  [A-Za-z_]+.*\(|ran [0-9] calls|Duration|DRAM Throughput|L2 Cache Throughput|L2 Hit|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Dynamic Shared|Grid Size|Spilling Requests  " \
#>     "$OUT/ncu_$1.txt" | cut -c1-200 | head -40
#> }
#> run bm128 2
#> cp scripts/gpu/s34_pairs_moe_grouped.py jaxk3/kernels/moe_grouped.py
#> run pairs 4
#> echo "== done ($(date -u +%T))"
#> } 2>&1 | tee "$P"
#   scripts/gpu/s34_grouped_forms.py:
#> """Thirty-fourth session: one grouped-GEMM form at the 48B's dims (4096 tokens x 8 of 256 experts), called CALLS times,
#> for Nsight Compute (`ncu -k regex:grouped_ --launch-skip <the first call's launches>`).
#> 
#>     python scripts/gpu/s34_grouped_forms.py default|bm128|pairs
#> (pairs: run with the thirty-third session's kernel file, 4fbd9e1's jaxk3/kernels/moe_grouped.py, copied in first)"""
#> import os
#> import sys
#> 
#> import jax
#> 
#> sys.path.insert(0, os.getcwd())
#> sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
#> import moe_grouped as M  # noqa: E402  (scripts/gpu/moe_grouped.py: case())
#> from jaxk3.kernels import moe_grouped as G  # noqa: E402
#> 
#> CALLS = 3
#> form = sys.argv[1]
#> cfg = M.load_config("kimi-linear-48b")
#> kcfg, w, z, wk, ids = M.case(cfg, 256, 4096)
#> c = {"default": None,
#>      "bm128": G.Config(bm=128, bn=128, bk=64, num_warps=8, num_stages=4, order="n"),
#>      "pairs": None if form != "pairs" else G.Config(bm=64, bn=128, bk=64, num_warps=4, num_stages=4, order="n",
#>                                                      block_pairs=True, pair_warps=8)}[form]
#> why = G.fits(kcfg, w, z, wk, ids, config=c)
#> assert why is None, why
#> f = jax.jit(lambda w, z, wk, ids: G.grouped(kcfg, w, z, wk, ids, config=c))
#> 
#> for _ in range(CALLS):
#>     y = jax.block_until_ready(f(w, z, wk, ids))
#> print(form, c or G.config_for(ids.size, 256, kcfg.moe_intermediate_size, kcfg.moe_hidden), "ran", CALLS, "calls",
#>       float(abs(y).max()))
#
# ---- call 5 (wall 65.5 s, warm): bash scripts/gpu/s34_call5.sh   (5_printed.txt, 5_grouped_tests.log, 5_moe_grouped.json)
#> #!/usr/bin/env bash
#> # Thirty-fourth session, call 5: the grouped GEMM split (gate|up on 128-row blocks on 8 warps, down on their 64-row
#> # halves on 4 warps: `moe_grouped.Config(down_bm=64, down_warps=4)`): compiled tests (its bits against whole blocks),
#> # then timed against the default before and after at the 48B's dims (4096 tokens x 8 of 256 experts).
#> # Predicted (call 4's Nsight Compute durations): gate|up 1.155 -> ~1.07 ms, down unchanged, the layer ~4% faster.
#> set -u
#> OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
#> P="$OUT/printed.txt"
#> {
#> OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|H100|H200|rror" | head -8
#> export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
#> echo "== grouped: compiled tests ($(date -u +%T))"
#> timeout -k 5 ${C5_TESTS:-90} python3 -m pytest tests/test_kernels.py -m gpu -k "grouped_kernel_on_gpu" -q -rfEs \
#>   -p no:cacheprovider > "$OUT/grouped_tests.log" 2>&1
#> echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/grouped_tests.log" | cut -c1-300 | tail -12
#> echo "== grouped: split against the default ($(date -u +%T))"
#> timeout -k 5 ${C5_BENCH:-200} python3 scripts/gpu/moe_grouped.py --json "$OUT/moe_grouped.json" --tokens 4096 --split --no-dense 2>&1 | cut -c1-260
#> echo "== done ($(date -u +%T))"
#> } 2>&1 | tee "$P"
#
# ---- call 6 (wall 30.2 s, warm): runs 2 and 3 of the split against the default (6_printed.txt, 6_moe_grouped_r*.json)
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92; for i in 1 2; do python3 scripts/gpu/moe_grouped.py --json $OUT/moe_grouped_r$i.json --tokens 4096 --split --no-dense 2>&1 | grep -E "kernel|gemm" | sed -E 's/Config\(bm=([0-9]+), bn=128, bk=64, num_warps=([0-9]), num_stages=([0-9]).*down_bm=([0-9]+), down_warps=([0-9])\)/bm\1 w\2 s\3 dbm\4 dw\5/' | cut -c1-150; done 2>&1 | tee $OUT/printed.txt
#
# ---- call 7 (not run: the device time left was too little to start a machine): the TTFT A/B of the split
#   cp docs/perf/2026-12-06/s34/7_ttft_split.py scripts/gpu/ && (OUT=/tmp/gc bash scripts/gpu_check.sh env build;
#   JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92 REPS=4 python3 scripts/gpu/7_ttft_split.py)
