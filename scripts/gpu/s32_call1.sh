#!/usr/bin/env bash
# Thirty-second session, call 1: the add_rms_norm kernel (add_norm.ADD_NORM) compiled at real dims, the 48B layers 0-3
# census (command buffers off) without and with it, and the 48B B = 1 step at 4K, main / ADD_NORM alternating, one
# process each.  Summaries go to $OUT/printed.txt; gpu_check's own logs stay on the machine.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="$OUT/printed.txt"
export OUT_GC=/tmp/gc
{
OUT=$OUT_GC bash scripts/gpu_check.sh env build
OUT=$OUT_GC KTEST_FILES=tests/test_kernels.py KTEST_K="add_rms_norm_on_gpu" KTEST_TIMEOUT=150 bash scripts/gpu_check.sh ktests
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
A="--config kimi-linear-48b --layers 0-3 --experts 64 --tp 1 --context 4k --batch 1 --strategies stock --variants serving/auto --steps 10 --census"
for run in main add; do
  echo "== census 48B layers 0-3, $run ($(date -u +%T))"
  if [ $run = main ]; then cmd="python3 -m jaxk3.cli bench decode"; else cmd="python3 scripts/gpu/step_with_kernel.py add_norm:ADD_NORM=1 --"; fi
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout -k 5 150 $cmd $A --json "$OUT/c_$run.json" > /tmp/c_$run.log 2>&1
  echo "rc $?"; grep -E "launch ops|moe |layer1_moe|add_rms|_moe.*us" /tmp/c_$run.log | head -12
done
S="--config kimi-linear-48b --layers all --experts 64 --tp 1 --context 4k --batch 1 --strategies stock --steps 20 --repeats 5"
for i in 1 2; do
  for run in main add; do
    echo "== 48B B = 1 4K step: $run $i ($(date -u +%T))"
    V=serving/auto; [ $i = 1 ] && V=serving/auto,serving/off
    if [ $run = main ]; then cmd="python3 -m jaxk3.cli bench decode"; else cmd="python3 scripts/gpu/step_with_kernel.py add_norm:ADD_NORM=1 --"; fi
    timeout -k 5 140 $cmd $S --variants $V --json "$OUT/s_${run}$i.json" 2>&1 | grep -E "^ +1 \||rror|copy bandwidth" | tail -4
  done
done
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/s_*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.rsplit("/", 1)[-1], r["strategy"], r.get("variant"), f"{r['us_per_step']:.1f} us, floor {r.get('floor_us', 0):.1f}, "
              f"x{r['ratio_to_floor']:.3f}, launches {r.get('launch_ops')}, logits vs first variant {r.get('logits_rel_diff')}, "
              f"tokens {r.get('tokens')}")
PY
} 2>&1 | tee "$P"
