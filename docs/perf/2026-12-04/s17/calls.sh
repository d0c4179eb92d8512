# The seventeenth session's device calls as run (docs/PERF.md, seventeenth-session section): C=N bash scripts/gpu/s17_call.sh,
# a temporary script copied here.  N_call.txt: each call's printed output; raw files start with the call's number.
# Call 1: the float16 form forced (Config.f16=1) against the default; call 2: the default for marked stacks at B > 1 (the bench's
# weights were not yet marked: its step rows ran mx_dot); call 3: the bench's weights marked as the loader marks them.
#!/usr/bin/env bash
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
O=$OUT; C=${C:-1}
t() { echo "== $* ($(date -u +%T))"; }
K3="--config k3 --layers 11-14 --experts 32 --tp 1 --context 4k --steps 20 --repeats 5 --strategies packed+sharded+one-shot"
if [ "$C" = 1 ]; then
  t tests
  timeout -k 5 120 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "f16_asm_on_gpu or (moe_experts_kernel_on_gpu and mxfp4 and config8)" > $O/1_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/1_tests.log | cut -c1-300 | tail -8
  t sweep
  timeout -k 5 170 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 1,8 --formats mxfp4 --configs "f16=1;f16=1,bn=64;f16=1,bk=256;f16=1,num_warps=8" --json $O/1_sweep.json 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
  t k3 b1 main; timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch 1 --json $O/1_k3b1_main.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t k3 b1 f16; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.f16=1 -- $K3 --batch 1 --json $O/1_k3b1_f16.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t k3 b8 main; timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch 8 --json $O/1_k3b8_main.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t k3 b8 f16; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.f16=1 -- $K3 --batch 8 --json $O/1_k3b8_f16.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t done
fi
if [ "$C" = 2 ]; then
  t tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider "$T[moe_experts_mxfp4-k3-1-8]" "$T[moe_experts_mxfp4-k3-2-8]" "$T[moe_experts_mxfp4-k3-8-8]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-8]" "$T[moe_experts_mxfp4-k3-1-1]" > $O/2_real_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/2_real_tests.log | cut -c1-300 | tail -8
  timeout -k 5 100 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "f16_asm_on_gpu or (moe_experts_kernel_on_gpu and mxfp4)" > $O/2_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/2_tests.log | cut -c1-300 | tail -8
  t sweep
  timeout -k 5 150 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 8 --formats mxfp4 --configs "f16=0;num_stages=4;num_stages=2;bk=64;bn=256" --json $O/2_sweep.json 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
  timeout -k 5 90 python3 scripts/gpu/moe_experts_sweep.py --preset kl --batch 8 --formats mxfp4 --configs "f16=0" --json $O/2_kl_sweep.json 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
  t k3 b8 main; timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch 8 --json $O/2_k3b8_main.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t k3 b8 mx_dot; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.f16=0 -- $K3 --batch 8 --json $O/2_k3b8_mxdot.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t k3 b8 without; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py -moe_experts -- $K3 --batch 8 --json $O/2_k3b8_without.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t done
fi
if [ "$C" = 3 ]; then
  t tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider "$T[moe_experts_mxfp4-k3-1-8]" "$T[moe_experts_mxfp4-k3-2-8]" "$T[moe_experts_mxfp4-k3-8-8]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-8]" > $O/3_real_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/3_real_tests.log | cut -c1-300 | tail -8
  timeout -k 5 100 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "f16_asm_on_gpu or (moe_experts_kernel_on_gpu and mxfp4)" > $O/3_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/3_tests.log | cut -c1-300 | tail -8
  t k3 b8 main; timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch 8 --json $O/3_k3b8_main.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t k3 b8 mx_dot; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.f16=0 -- $K3 --batch 8 --json $O/3_k3b8_mxdot.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t k3 b8 main again; timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch 8 --json $O/3_k3b8_main2.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t k3 b1 main; timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch 1 --json $O/3_k3b1_main.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t done
fi

# Call 4: the float16 form at one token with smaller tiles (all slower than the default), and its step A/B.
if [ "$C" = 4 ]; then
  t sweep b1
  timeout -k 5 150 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 1 --formats mxfp4 --configs "f16=1,bn=16;f16=1,bn=32;f16=1,bn=32,num_stages=4;f16=1,bn=64,num_stages=5;f16=1,bn=16,num_warps=2" --json $O/4_sweep.json 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
  t k3 b1 main; timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch 1 --json $O/4_k3b1_main.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t k3 b1 f16 bn32; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.f16=1 moe_experts:Config.bn=32 -- $K3 --batch 1 --json $O/4_k3b1_f16bn32.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t done
fi

# Call 5: Nsight Compute on the float16 form's two kernels (scripts/gpu/s17_ncu.sh, as run):
#   #!/usr/bin/env bash
#   export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
#   O=$OUT
#   which ncu || ls /opt/nvidia/nsight-compute/*/ncu
#   NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
#   for cfg in ""; do
#     tag=${cfg:-f16}
#     echo "== $tag ($(date -u +%T))"
#     timeout -k 5 200 $NCU --clock-control none --target-processes all -k regex:"gate_up|down" --launch-skip 6 --launch-count 2 \
#       --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis \
#       python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 8 --formats mxfp4 --configs "$cfg" --json $O/ncu_$tag.json > $O/ncu_$tag.txt 2>&1
#     echo "rc $?"; grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp|No Eligible|Stall|Block Limit" $O/ncu_$tag.txt | head -60
#   done

# Calls 6 and 7: kernel 2's slots split over programs (slot_splits), then main with it the default.
if [ "$C" = 6 ]; then
  t tests
  timeout -k 5 100 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "moe_experts_kernel_on_gpu and mxfp4 and (config8 or None)" > $O/6_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/6_tests.log | cut -c1-300 | tail -8
  t sweep
  timeout -k 5 150 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 8 --formats mxfp4 --configs "slot_splits=2;slot_splits=3;slot_splits=4;slot_splits=2,bn=64" --json $O/6_sweep.json 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
  t k3 b8 main; timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch 8 --json $O/6_k3b8_main.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t k3 b8 slot2; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.slot_splits=2 -- $K3 --batch 8 --json $O/6_k3b8_slot2.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t k3 b8 slot3; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.slot_splits=3 -- $K3 --batch 8 --json $O/6_k3b8_slot3.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t done
fi
if [ "$C" = 7 ]; then
  t tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 100 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider "$T[moe_experts_mxfp4-k3-1-8]" "$T[moe_experts_mxfp4-k3-2-8]" "$T[moe_experts_mxfp4-k3-8-8]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-8]" > $O/7_real_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/7_real_tests.log | cut -c1-300 | tail -4
  timeout -k 5 70 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "f16_asm_on_gpu or (moe_experts_kernel_on_gpu and mxfp4 and (config8 or None))" > $O/7_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/7_tests.log | cut -c1-300 | tail -4
  t k3 b8 main; timeout -k 5 70 python3 -m jaxk3.cli bench decode $K3 --batch 8 --json $O/7_k3b8_main.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t k3 b8 one part; timeout -k 5 70 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.slot_splits=1 -- $K3 --batch 8 --json $O/7_k3b8_slot1.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t done
fi

# Call 8: Nsight Compute on the one-token group form's two kernels (as call 5, --batch 1; output 8_ncu_b1.txt):
#   #!/usr/bin/env bash
#   export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
#   O=$OUT
#   timeout -k 5 200 ncu --clock-control none --target-processes all -k regex:"gate_up|down" --launch-skip 6 --launch-count 2 \
#     --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis \
#     python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 1 --formats mxfp4 --configs "" --json $O/8_ncu_b1.json > $O/8_ncu_b1.txt 2>&1
#   echo "rc $?"; grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issued Warp|No Eligible|Waves Per SM|Grid Size" $O/8_ncu_b1.txt | head -40

# Call 9: kernel 2's slot parts at one token (measured, not taken).
if [ "$C" = 9 ]; then
  t sweep b1
  timeout -k 5 90 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 1 --formats mxfp4 --configs "slot_splits=2;slot_splits=3;slot_splits=4" --json $O/9_sweep.json 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
  t k3 b1 main; timeout -k 5 60 python3 -m jaxk3.cli bench decode $K3 --batch 1 --json $O/9_k3b1_main.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t k3 b1 slot2; timeout -k 5 60 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.slot_splits=2 -- $K3 --batch 1 --json $O/9_k3b1_slot2.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t k3 b1 slot3; timeout -k 5 60 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.slot_splits=3 -- $K3 --batch 1 --json $O/9_k3b1_slot3.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t done
fi
