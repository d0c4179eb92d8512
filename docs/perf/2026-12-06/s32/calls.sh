# thirty-second session, 2026-12-06, 1x H100 80GB HBM3 each call (the device tool gave an H100 for every call, the first
# named nvidia-h200), jax/jaxlib 0.11.2, Python 3.12.3 (the device image), driver 580.159.04. Files start with their
# call's number; N_printed.txt is call N's printed output.
# Trees: call 1 ran 9ea222b (the add_rms_norm form, off by default: add_norm.ADD_NORM); call 2 ran the working tree that
# was then committed as c8152b0 (add_norm.BK, the compiled test's oracle compiled as the step is), with the untracked
# scripts/gpu/add_norm_sweep.py (kept here as 2_add_norm_sweep.py); calls 3 and 4 ran that tree with the thirty-first
# session's ../s31/4_triton_fusions.patch applied on the device only (the commands below apply it), call 4 with the
# untracked scripts/gpu/fusion_probe.py (kept here as 4_fusion_probe.py). The form is 1_add_rms_norm.patch (7cb5812 to
# c8152b0, code and tests); 7d192f6 removed it. The device's copy of the tree travels with untracked files, so the
# scripts needed no copy step.
#
# ---- call 1 (wall 530.7 s): scripts/gpu/s32_call1.sh as run
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
# (the first step process, main with two variants, ran past its 140 s timeout and printed no row: call 2 repeats main)
#
# ---- call 2 (wall 531.5 s): scripts/gpu/s32_call2.sh as run (the sweep is 2_add_norm_sweep.py here)
#!/usr/bin/env bash
# Thirty-second session, call 2: add_rms_norm's compiled tests (the oracle compiled as the step is), the kernel alone
# against XLA's two kernels by tiling (and a launch's floor, XLA against Pallas), and the 48B step with the best tiling
# only where it beat XLA alone.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="$OUT/printed.txt"
{
OUT=/tmp/gc bash scripts/gpu_check.sh build
OUT=/tmp/gc KTEST_FILES=tests/test_kernels.py KTEST_K="add_rms_norm_on_gpu" KTEST_TIMEOUT=150 bash scripts/gpu_check.sh ktests
cp /tmp/gc/ktests.log "$OUT/ktests.log"
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
for S in 4 1; do
  echo "== add_rms_norm alone, S $S ($(date -u +%T))"
  timeout -k 5 150 python3 scripts/gpu/add_norm_sweep.py --S $S --json "$OUT/sweep_S$S.json" 2>&1 | grep -v Warning
done
python3 - "$OUT" > /tmp/best.txt <<'PY'
import json, sys
r = json.load(open(sys.argv[1] + "/sweep_S4.json"))
best = min((k for k in r if k.startswith("nw")), key=r.get)
nw, bk = best[2:].split("_bk")
print(f"{nw} {bk} {int(r[best] < r['xla'] - 0.3)}")
PY
read nw bk win < /tmp/best.txt
echo "best num_warps $nw bk $bk, beat XLA alone: $win"
if [ "$win" = 1 ]; then
  S="--config kimi-linear-48b --layers all --experts 64 --tp 1 --context 4k --batch 1 --strategies stock --variants serving/auto --steps 20 --repeats 5"
  for run in main add main add; do
    echo "== 48B B = 1 4K step: $run ($(date -u +%T))"
    if [ $run = main ]; then cmd="python3 -m jaxk3.cli bench decode"
    else cmd="python3 scripts/gpu/step_with_kernel.py add_norm:ADD_NORM=1 add_norm:NUM_WARPS=$nw add_norm:BK=$bk --"; fi
    timeout -k 5 110 $cmd $S 2>&1 | grep -E "^ +1 \||rror" | tail -3
  done
fi
} 2>&1 | tee "$P"
#
# ---- call 3 (wall 177.1 s): the thirty-first session's probe (../s31/4_fusion_logits.py), in range and as run then
#!/usr/bin/env bash
# Thirty-second session, call 3: the thirty-first session's unexplained divergence of XLA's Triton fusions
# (4_triton_fusions.patch, applied in this copy only): the in-range probe (every step's token inside the cache), then
# the probe as that session ran it (the cache full from the second step).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="$OUT/printed.txt"
{
D=docs/perf/2026-12-06/s31
git apply $D/4_triton_fusions.patch && echo "patch applied"
cp $D/4_fusion_logits.py scripts/gpu/fusion_logits.py
sed 's/a.context - 1 - a.steps/a.context - 1/' $D/4_fusion_logits.py > scripts/gpu/fusion_logits_full.py
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
echo "== in range ($(date -u +%T))"
timeout -k 5 230 python3 scripts/gpu/fusion_logits.py --steps 8 2>&1 | grep -vi warn | tail -12
echo "== past the cache from the second step ($(date -u +%T))"
timeout -k 5 200 python3 scripts/gpu/fusion_logits_full.py --steps 8 2>&1 | grep -vi warn | tail -12
echo "== end ($(date -u +%T))"
} 2>&1 | tee "$P"
#
# ---- call 4 (wall 166.5 s): the probe narrowed (4_fusion_probe.py here, scripts/gpu/fusion_probe.py as run)
#!/usr/bin/env bash
# Thirty-second session, call 4: scripts/gpu/fusion_probe.py with 4_triton_fusions.patch applied in this copy only.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
git apply docs/perf/2026-12-06/s31/4_triton_fusions.patch && echo "patch applied"
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
echo "== in range, 6 steps ($(date -u +%T))"
timeout -k 5 250 python3 scripts/gpu/fusion_probe.py --steps 6 2>&1 | grep -vi warn | tail -16
echo "== end ($(date -u +%T))"
} 2>&1 | tee "$OUT/printed.txt"
