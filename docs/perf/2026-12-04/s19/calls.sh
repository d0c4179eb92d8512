# The nineteenth session's device calls as run (docs/PERF.md, nineteenth-session section): C=N bash scripts/gpu/s19_call.sh,
# a temporary script copied here.  N_call.txt: each call's printed output; raw files start with the call's number.
# Calls 3 and 4 ran the CUDA kernel 1 with two and four iterations' loads in flight (call 4's is the landed source; the
# default from call 4 on), call 6 three template instances of it (not landed; its VARIANT attribute is gone).
#!/usr/bin/env bash
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
O=$OUT; C=${C:-1}
t() { echo "== $* ($(date -u +%T))"; }
K3="--config k3 --layers 11-14 --experts 32 --tp 1 --context 4k --steps 20 --repeats 5 --strategies packed+sharded+one-shot"
KL="--config kimi-linear-48b --layers all --experts 64 --tp 1 --context 4k --strategies stock --variants serving/auto --steps 20 --repeats 5"
step() { # tag batch patches...
  local tag=$1 b=$2; shift 2
  t "k3 b$b $tag"
  if [ $# = 0 ]; then timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch $b --json $O/${C}_k3b${b}_$tag.json 2>&1 | grep -E "^ +$b \||rror" | tail -3
  else timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py "$@" -- $K3 --batch $b --json $O/${C}_k3b${b}_$tag.json 2>&1 | grep -E "^ +$b \||rror" | tail -3; fi
}
klstep() { # tag batch patches...
  local tag=$1 b=$2; shift 2
  t "48b b$b $tag"
  if [ $# = 0 ]; then timeout -k 5 150 python3 -m jaxk3.cli bench decode $KL --batch $b --json $O/${C}_48bb${b}_$tag.json 2>&1 | grep -E "^ +$b \||rror" | tail -3
  else timeout -k 5 150 python3 scripts/gpu/step_with_kernel.py "$@" -- $KL --batch $b --json $O/${C}_48bb${b}_$tag.json 2>&1 | grep -E "^ +$b \||rror" | tail -3; fi
}
sweep() { # preset batch formats configs
  t "sweep $1 b$2 $3"
  timeout -k 5 170 python3 scripts/gpu/moe_experts_sweep.py --preset $1 --batch $2 --formats $3 --configs "$4" --json $O/${C}_sweep_$1_b$2_$3.json 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
}
if [ "$C" = 1 ]; then
  t tests
  timeout -k 5 120 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "moe_experts_kernel_on_gpu and config11" > $O/1_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/1_tests.log | cut -c1-300 | tail -8
  sweep kl 8 bf16 "swap=1;swap=1,num_stages=1;swap=1,bk=256,num_stages=1"
  sweep k3 8 bf16 "swap=1;swap=1,num_stages=1"
  sweep kl 1 bf16 "num_stages=1;num_stages=2;num_warps=8"
  sweep k3 1 mxfp4 "num_stages=1;num_stages=2"
  t done
fi
if [ "$C" = 2 ]; then
  klstep main 1
  klstep ns2 1 moe_experts:Config.num_stages=2
  klstep main2 1
  klstep ns2b 1 moe_experts:Config.num_stages=2
  klstep swap 8 moe_experts:Config.swap=1
  klstep main 8
  step ns2 1 moe_experts:Config.num_stages=2
  step main 1
  t done
fi
build() {
  t build
  JAXK3_CUDA=ON JAXK3_CUDA_ARCHS=90 timeout -k 5 300 python3 -m pip install -v --no-build-isolation --no-deps -e . > $O/${C}_build.log 2>&1
  echo "build rc $?"; tail -2 $O/${C}_build.log | cut -c1-200; grep -E " error|Error" $O/${C}_build.log | head -20
  python3 -c "from jaxk3.kernels import mxfp4_gate_up as CU; print('cuda gate-up:', CU.unavailable() or 'available')"
}
if [ "$C" = 3 ]; then
  build
  t tests
  timeout -k 5 150 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "cuda_gate_up" > $O/3_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror|Mismatch|Max abs" $O/3_tests.log | cut -c1-300 | tail -12
  sweep k3 1 mxfp4 "cuda=1"
  step cuda 1 moe_experts:Config.cuda=1
  step main 1
  step cuda2 1 moe_experts:Config.cuda=1
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 100 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider "$T[moe_experts-kimi-linear-48b-1-8]" > $O/3_real_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/3_real_tests.log | cut -c1-300 | tail -8
  t done
fi
if [ "$C" = 4 ]; then
  build
  t tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_kernels.py -k "cuda_gate_up or (moe_experts_kernel_on_gpu and mxfp4 and None and checkpoint)" "$T[moe_experts_mxfp4-k3-1-1]" "$T[moe_experts_mxfp4-k3-2-1]" "$T[moe_experts_mxfp4-k3-8-1]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-1]" > $O/4_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror|Mismatch|Max abs" $O/4_tests.log | cut -c1-300 | tail -12
  sweep k3 1 mxfp4 "cuda=0"
  step main 1
  step pallas 1 moe_experts:CUDA_GATE_UP=0
  step main2 1
  step pallas2 1 moe_experts:CUDA_GATE_UP=0
  t done
fi
if [ "$C" = 5 ]; then
  build
  t real-dims tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider "$T[moe_experts_mxfp4-k3-1-1]" "$T[moe_experts_mxfp4-k3-2-1]" "$T[moe_experts_mxfp4-k3-8-1]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-1]" > $O/5_real_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror|Mismatch|Max abs" $O/5_real_tests.log | cut -c1-300 | tail -12
  klstep main 8
  klstep swap0 8 moe_experts:Config.swap=0
  t ncu
  NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
  timeout -k 5 120 $NCU --clock-control none --target-processes all -k regex:"GateUp|down" --launch-skip 4 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
    python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 1 --formats mxfp4 --configs "" > $O/5_ncu.txt 2>&1
  echo "rc $?"; grep -E "^  [A-Za-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp|No Eligible|Waves Per SM|Block Limit" $O/5_ncu.txt | head -40
  grep -E "stalled_.*ratio" $O/5_ncu.txt | awk '$NF+0 > 0.3' | head -30
  t done
fi
if [ "$C" = 6 ]; then
  build
  for v in 0 1 2 0; do
    t "variant $v"
    timeout -k 5 60 python3 -c "
import runpy, sys
import jaxk3.kernels.mxfp4_gate_up as CU
CU.VARIANT = $v
sys.argv = ['moe_experts_sweep.py', '--preset', 'k3', '--batch', '1', '--formats', 'mxfp4', '--configs', 'cuda=0', '--json', '$O/6_sweep_v$v.json']
runpy.run_path('scripts/gpu/moe_experts_sweep.py', run_name='__main__')
" 2>&1 | grep -E "kernel|xla" | cut -c1-160
  done
  t done
fi
if [ "$C" = 7 ]; then
  build
  for v in 0 1; do
    t "variant $v"
    timeout -k 5 60 python3 -c "
import runpy, sys
import jaxk3.kernels.mxfp4_gate_up as CU
CU.VARIANT = $v
sys.argv = ['moe_experts_sweep.py', '--preset', 'k3', '--batch', '1', '--formats', 'mxfp4', '--configs', 'cuda=0', '--json', '$O/7_sweep_v$v.json']
runpy.run_path('scripts/gpu/moe_experts_sweep.py', run_name='__main__')
" 2>&1 | grep -E "kernel|xla" | cut -c1-160
  done
  step main 1
  step pallas 1 moe_experts:CUDA_GATE_UP=0
  t done
fi
