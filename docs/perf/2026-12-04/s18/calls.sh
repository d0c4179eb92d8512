# The eighteenth session's device calls as run (docs/PERF.md, eighteenth-session section): C=N bash scripts/gpu/s18_call.sh,
# a temporary script copied here.  N_call.txt: each call's printed output; raw files start with the call's number.
# Call 1 ran `Config.swap` as an experimental field (off by default, the one-scale PTX); from call 2 it is the default
# with f16 and the PTX takes each pair's scale; calls 5-6 have kernel 2's 4 slot parts at one token; call 9 the
# one-stage bk 256 defaults.  Calls 7 and 8 were typed inline (below the script).
#!/usr/bin/env bash
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
O=$OUT; C=${C:-1}
t() { echo "== $* ($(date -u +%T))"; }
K3="--config k3 --layers 11-14 --experts 32 --tp 1 --context 4k --steps 20 --repeats 5 --strategies packed+sharded+one-shot"
step() { # tag batch patches...
  local tag=$1 b=$2; shift 2
  t "k3 b$b $tag"
  if [ $# = 0 ]; then timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch $b --json $O/${C}_k3b${b}_$tag.json 2>&1 | grep -E "^ +$b \||rror" | tail -3
  else timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py "$@" -- $K3 --batch $b --json $O/${C}_k3b${b}_$tag.json 2>&1 | grep -E "^ +$b \||rror" | tail -3; fi
}
sweep() { # batch configs
  t "sweep b$1"
  timeout -k 5 170 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch $1 --formats mxfp4 --configs "$2" --json $O/${C}_sweep_b$1.json 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
}
if [ "$C" = 1 ]; then
  t tests
  timeout -k 5 150 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "moe_experts_kernel_on_gpu and mxfp4 and (config9 or config10)" > $O/1_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/1_tests.log | cut -c1-300 | tail -8
  sweep 8 "swap=1;swap=1,bn=64;swap=1,bn=64,bk=64;swap=1,bn=64,num_stages=4"
  sweep 1 "f16=1,swap=1;f16=1,swap=1,bn=64;f16=1,swap=1,bn=64,bk=64;f16=1,swap=1,bn=64,num_stages=4"
  step main 8
  step swap 8 moe_experts:Config.swap=1
  step swapbn64 8 moe_experts:Config.swap=1 moe_experts:Config.bn=64
  step main 1
  step slot4 1 moe_experts:Config.slot_splits=4
  step f16swapbn64 1 moe_experts:Config.f16=1 moe_experts:Config.swap=1 moe_experts:Config.bn=64
  t done
fi
if [ "$C" = 2 ]; then
  t tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider "$T[moe_experts_mxfp4-k3-1-8]" "$T[moe_experts_mxfp4-k3-2-8]" "$T[moe_experts_mxfp4-k3-8-8]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-8]" > $O/2_real_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/2_real_tests.log | cut -c1-300 | tail -8
  timeout -k 5 150 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "f16_asm_on_gpu or (moe_experts_kernel_on_gpu and mxfp4 and (config8 or config9 or config10))" > $O/2_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/2_tests.log | cut -c1-300 | tail -8
  sweep 8 "swap=0;num_warps=8;bk=256;num_stages=4;bn=256,num_warps=8"
  t kl sweep; timeout -k 5 90 python3 scripts/gpu/moe_experts_sweep.py --preset kl --batch 8 --formats mxfp4 --configs "swap=0" 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
  step main 8
  step swap0 8 moe_experts:Config.swap=0
  step main2 8
  step swap0b 8 moe_experts:Config.swap=0
  t done
fi
if [ "$C" = 3 ]; then
  sweep 8 "bk=64;bk=64,num_stages=4;bk=64,num_stages=5;num_stages=2"
  # the sweep's fastest non-default row as step_with_kernel.py patches (none: the default)
  BEST=$(python3 - $O/3_sweep_b8.json <<'PY'
import json, re, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["path"].startswith("kernel")]
best = min(rows, key=lambda r: r["us"])
name = best["name"].removeprefix("kernel ").strip()
print("" if name == "default" else " ".join(f"moe_experts:Config.{f.strip()}" for f in name.split(",")))
PY
)
  echo "best: ${BEST:-default}"
  step main 8
  [ -n "$BEST" ] && step best 8 $BEST
  step slot4 8 moe_experts:Config.slot_splits=4
  step main2 8
  [ -n "$BEST" ] && step best2 8 $BEST
  t done
fi
if [ "$C" = 4 ]; then
  sweep 8 "splits=3,slot_splits=16;splits=2,slot_splits=16;splits=6,slot_splits=8;splits=4,slot_splits=8;splits=1,slot_splits=32"
  BEST=$(python3 - $O/4_sweep_b8.json <<'PY'
import json, re, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["path"].startswith("kernel")]
best = min(rows, key=lambda r: r["us"])
name = best["name"].removeprefix("kernel ").strip()
print("" if name == "default" else " ".join(f"moe_experts:Config.{f.strip()}" for f in name.split(",")))
PY
)
  echo "best: ${BEST:-default}"
  if [ -n "$BEST" ]; then step best 8 $BEST; step main 8; step best2 8 $BEST; fi
  t done
fi
if [ "$C" = 5 ]; then
  t tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider "$T[moe_experts_mxfp4-k3-1-1]" "$T[moe_experts_mxfp4-k3-2-1]" "$T[moe_experts_mxfp4-k3-8-1]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-1]" > $O/5_real_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/5_real_tests.log | cut -c1-300 | tail -8
  timeout -k 5 100 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "moe_experts_kernel_on_gpu and mxfp4 and config0" > $O/5_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/5_tests.log | cut -c1-300 | tail -8
  sweep 1 "slot_splits=1"
  step main 1
  step slot1 1 moe_experts:Config.slot_splits=1
  step main2 1
  step slot1b 1 moe_experts:Config.slot_splits=1
  t done
fi
if [ "$C" = 6 ]; then
  t tests
  timeout -k 5 150 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "f16_asm_on_gpu or asm_decode_on_gpu or (moe_experts_kernel_on_gpu and mxfp4 and None)" > $O/6_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/6_tests.log | cut -c1-300 | tail -8
  t ncu
  NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
  timeout -k 5 240 $NCU --clock-control none --target-processes all -k regex:"gate_up|down" --launch-skip 6 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
    python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 8 --formats mxfp4 --configs "" > $O/6_ncu_swap.txt 2>&1
  echo "rc $?"; grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp|No Eligible|Waves Per SM|Block Limit Registers" $O/6_ncu_swap.txt | head -40
  grep -E "stalled_.*ratio" $O/6_ncu_swap.txt | awk '$NF+0 > 0.2' | head -40
  t done
fi
if [ "$C" = 9 ]; then
  t tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider "$T[moe_experts_mxfp4-k3-1-8]" "$T[moe_experts_mxfp4-k3-2-8]" "$T[moe_experts_mxfp4-k3-8-8]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-8]" > $O/9_real_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/9_real_tests.log | cut -c1-300 | tail -8
  timeout -k 5 150 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "f16_asm_on_gpu or (moe_experts_kernel_on_gpu and mxfp4 and (None or config8 or config9 or config10))" > $O/9_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/9_tests.log | cut -c1-300 | tail -8
  sweep 8 "bk=128,num_stages=3"
  step main 8
  step main2 8
  t done
fi

# Call 7 (inline, the machine still warm after call 6):
#   export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
#   python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 8 --formats mxfp4 \
#     --configs "num_stages=1;num_stages=1,bk=256;num_stages=1,bn=64;num_stages=2,bk=256" --json $OUT/7_sweep_b8.json
# Call 8 (inline):
#   python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 8 --formats mxfp4 \
#     --configs "bk=256,num_stages=1;bk=512,num_stages=1;bk=256,num_stages=1,num_warps=8" --json $O/8_sweep_b8.json
#   for r in a b; do
#     python3 scripts/gpu/step_with_kernel.py moe_experts:Config.bk=256 moe_experts:Config.num_stages=1 -- $K3 --batch 8 --json $O/8_k3b8_bk256s1_$r.json
#     python3 -m jaxk3.cli bench decode $K3 --batch 8 --json $O/8_k3b8_main_$r.json
#   done
