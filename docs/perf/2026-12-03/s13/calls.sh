# The thirteenth session's device calls as run (call 1 is scripts/gpu/ab_call.sh; see docs/PERF.md).
# call 1
T_TIMEOUT=240 TEST_FILES="tests/test_kernels.py tests/test_kernels_real.py" TEST_K="ring_on_gpu or (kernel_real_dims and prefill)" AB="kda_decode:RING=1@1 kda_decode:RING=1@8" AGAIN=1 bash scripts/gpu/ab_call.sh
# call 2
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
MD_TIMEOUT=150 bash scripts/gpu_check.sh mxfp4dec
echo "== sweep k3 ($(date -u +%T))"
timeout -k 10 170 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --json "$OUT/moe_experts_sweep.json" 2>&1 | cut -c1-220
echo "== prefill tests ($(date -u +%T))"
T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
ids="$T[mla_prefill-k3-8-8] $T[mla_prefill-kimi-linear-48b-1-1] $T[mla_prefill-kimi-linear-48b-1-8]"
for c in k3-1-1 k3-1-8 k3-2-1 k3-2-8 k3-8-1 k3-8-8 kimi-linear-48b-1-1 kimi-linear-48b-1-8; do ids="$ids $T[mla_prefill_heads-$c]"; done
timeout -k 10 230 python3 -m pytest $ids -m gpu -v -rfEs -p no:cacheprovider --durations=0 > "$OUT/prefill_tests.log" 2>&1
echo "rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/prefill_tests.log" | cut -c1-200 | tail -14
echo "== done ($(date -u +%T))"
# call 3
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
S="--config kimi-linear-48b --layers all --experts 64 --tp 1 --context 4k --strategies stock --variants serving/auto --steps 20 --repeats 5"
row() { grep -E "^ +[0-9]+ \|" | tail -3; }
echo "== tests ($(date -u +%T))"
timeout -k 10 170 python3 -m pytest tests/test_pdl.py -m gpu -v -rfEs -p no:cacheprovider > "$OUT/pdl_tests.log" 2>&1
echo "rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/pdl_tests.log" | cut -c1-300 | tail -12
for run in "1 main" "1 early" "8 main" "8 early" "1 again"; do
  set -- $run; B=$1; what=$2
  echo "== B = $B, $what ($(date -u +%T))"
  if [ "$what" = early ]; then
    timeout -k 10 140 python3 scripts/gpu/step_with_kernel.py registry:PDL_EARLY=1 -- $S --batch "$B" --json "$OUT/ab_${what}_b$B.json" 2>&1 | row
  else
    timeout -k 10 140 python3 -m jaxk3.cli bench decode $S --batch "$B" --json "$OUT/ab_${what}_b$B.json" 2>&1 | row
  fi
done
echo "== done ($(date -u +%T))"
# call 4
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
S="--config kimi-linear-48b --layers all --experts 64 --tp 1 --context 4k --strategies stock --variants serving/auto --steps 5 --repeats 1 --batch 1"
for run in ring1 shift1 ring2 shift2; do
  echo "== $run ($(date -u +%T))"
  if [ "${run%?}" = shift ]; then
    timeout -k 10 75 python3 scripts/gpu/step_with_kernel.py kda_decode:RING=0 -- $S --json "$OUT/tok_$run.json" 2>&1 | grep -E "^ +[0-9]+ \|" | tail -1
  else
    timeout -k 10 75 python3 -m jaxk3.cli bench decode $S --json "$OUT/tok_$run.json" 2>&1 | grep -E "^ +[0-9]+ \|" | tail -1
  fi
  python3 -c "import json,sys; r=json.load(open('$OUT/tok_$run.json'))['rows'][0]; print(r['tokens'], r['top2_margin'])"
done
echo "== done ($(date -u +%T))"
# call 5 failed at once (no --synced 0 option); call 6:
export XLA_FLAGS=--xla_gpu_autotune_level=0; S="--config kimi-linear-48b --layers all --experts 64 --tp 1 --context 4k --strategies stock --variants serving/auto --steps 2 --repeats 1 --batch 1"; for r in a b; do python3 -m jaxk3.cli bench decode $S --json $OUT/na_$r.json; done
