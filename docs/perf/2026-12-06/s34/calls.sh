# thirty-fourth session, 2026-12-06, 1x H100 80GB HBM3 (calls 1-3, one warm machine), jax/jaxlib 0.11.2, Python 3.12
# (the device image). Files start with their call's number; N_printed.txt is call N's printed output. The tree at
# c2de51f's code (77ce1ea changed tests/test_aot.py only) with the untracked scripts below.
# The first try (15:57, named nvidia-h200) got no machine (181 s); the second (16:09, named nvidia-h200, needs_h200
# not set) was given this H100.
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
