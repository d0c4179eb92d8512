#!/usr/bin/env bash
# Thirty-eighth session's device calls, as run (each in the device tool's copy of the working tree at that commit), all on
# one 1x NVIDIA H200 (jax/jaxlib 0.11.2, CUDA 13; the device image).  Outputs: files starting with their call's number.
# Call 1 (fresh machine, 92 s; d85b29a): the 48B bf16 MoE experts kernel's tilings at B = 1 alone, then the MXFP4
# targets (K3's TP 2 share, B 1 and 8).  s38_call1.sh beside this file, as run from scripts/gpu/ (retired there after).
OUT=$OUT C1_BF_T=170 C1_MX_T=130 bash scripts/gpu/s38_call1.sh
# Call 2 (warm, 341 s; 445e1d5, whose moe_experts.Config.joint was removed after it in 436bd38): joint alone, then the
# 48B B = 1 step main / joint / main again (the compiled test's 90 s ran out before its first result: rc 124).
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
python3 scripts/gpu/moe_experts_sweep.py --preset kl --batch 1 --formats bf16 --configs "joint=1;bn=32,num_warps=8,joint=1" \
  --json $OUT/moe_kl_b1_joint.json
OUT=$OUT/ab AGAIN=1 T_TIMEOUT=90 TEST_FILES=tests/test_kernels.py TEST_K="joint_gate_up" S_TIMEOUT=120 \
  AB="moe_experts:Config.joint=1@1" bash scripts/gpu/ab_call.sh
# Call 3 (warm, 55 s): kernel 1's tilings around main's, the sweep twice (bn=16 is main's tiling spelled out: the noise)
for i in 1 2; do
  python3 scripts/gpu/moe_experts_sweep.py --preset kl --batch 1 --formats bf16 \
    --configs "bn=16;bn=16,bk=128;bn=16,num_stages=2;bn=16,num_warps=2;bn=8;bn=16,num_warps=8;bn=8,num_warps=2" \
    --json $OUT/moe_kl_b1_s$i.json
done
# Call 4 (warm, 210 s): the step with bn 8 (the only tiling ahead in both sweeps): main / bn 8 / main again
OUT=$OUT/ab AGAIN=1 S_TIMEOUT=120 AB="moe_experts:Config.bn=8@1" bash scripts/gpu/ab_call.sh
# Call 5 (fresh machine, 62 s): what one read-only XLA kernel streams at the step's sizes, twice
python3 scripts/gpu/read_floor.py --json $OUT/read_floor.json
python3 scripts/gpu/read_floor.py --json $OUT/read_floor2.json
