# thirty-first session, 2026-12-06, 1x H100 80GB HBM3 (the device tool's H100 kind; no H200 came), jax/jaxlib 0.11.2,
# Python 3.12.3 (the device image), driver 580.159.04. Files start with their call's number; N_printed.txt is call N's
# printed output (the tool returns at most 8 files).
# call 1 (wall 422.5 s; main at 485c8f2)
bash scripts/gpu_check.sh env build
KTEST_FILES=tests/test_kernels.py KTEST_K=mla_decode_uv_on_gpu KTEST_TIMEOUT=150 bash scripts/gpu_check.sh ktests
MLA_ARGS=--heads MLA_TIMEOUT=120 bash scripts/gpu_check.sh mla
S="--config kimi-linear-48b --layers all --experts 64 --tp 1 --batch 1 --strategies stock --variants serving/auto --steps 20 --repeats 5"
for ctx in 32k 4k; do
  python3 -m jaxk3.cli bench decode $S --context $ctx --json $OUT/s${ctx}_main.json
  python3 scripts/gpu/step_with_kernel.py mla_decode:BLOCK_H=32 -- $S --context $ctx --json $OUT/s${ctx}_bh32.json
done
# call 2 (wall 366.1 s): the loads-first forms (2_loads_first.patch applied to 485c8f2, on by default in that tree, with
# tests not in the patch: test_kda_decode_loads_first(_on_gpu), test_gemv_gnorm_loads_first(_on_gpu); so
# in this call "main" ran the loads-first form and "old" main's order: the files are renamed accordingly, 2_s_lf* /
# 2_c_lf the loads-first form, 2_s_main / 2_c_main main's order; 2_printed.txt keeps the labels as run)
bash scripts/gpu_check.sh build
KTEST_FILES="tests/test_kernels.py tests/test_gemv.py" KTEST_K="loads_first or kda_decode_in_kernel_on_gpu or gemv_gnorm_on_gpu" bash scripts/gpu_check.sh ktests
OLD="kda_decode:LOADS_FIRST=0 gemv:GNORM_LOADS_FIRST=0"
A="--config kimi-linear-48b --layers 0-3 --experts 64 --tp 1 --context 4k --batch 1 --strategies stock --variants serving/auto --steps 10 --census"
XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 -m jaxk3.cli bench decode $A --json $OUT/c_main.json   # -> 2_c_lf.json
XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/gpu/step_with_kernel.py $OLD -- $A --json $OUT/c_old.json   # -> 2_c_main.json
S4="$S --context 4k"
python3 -m jaxk3.cli bench decode $S4 --json $OUT/s_main.json            # the loads-first form (renamed 2_s_lf.json)
python3 scripts/gpu/step_with_kernel.py $OLD -- $S4 --json $OUT/s_old.json   # main's order (renamed 2_s_main.json)
#   then both again (s_main2.json -> 2_s_lf2.json; s_old2.json did not come back: the tool returns 8 files)
# call 3 (wall 47.4 s; 485c8f2 with the kernels named, as committed in 664877a): Nsight Compute on the 48B step's
# Pallas kernels, which crashed (rc 139) at the step
XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --clock-control none --target-processes all \
  -k regex:"kda_step|gemv|mla_|_merge_uv|_gate_up_kernel|_down_kernel" --launch-skip 66 --launch-count 22 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
  python3 -m jaxk3.cli bench decode --config kimi-linear-48b --layers 0-3 --experts 64 --tp 1 --context 4k --batch 1 \
  --strategies stock --variants serving/auto --steps 5 --repeats 1
# call 4 (wall 445.7 s; the tree of call 3 with 4_triton_fusions.patch: jaxk3.model.TRITON_FUSIONS): XLA's Triton
# emitter for its own fusions
bash scripts/gpu_check.sh build
python3 scripts/gpu/fusion_logits.py --steps 8   # 4_fusion_logits.py as run, but for the cache length: the run's
#   cache held context - 1 tokens (one free slot), so from its second step on the rows' length was past the cache's
#   slots; the file here starts the steps 8 slots earlier (checked on the CPU only: the device time had run out)
python3 -m jaxk3.cli bench decode $S4 --json $OUT/s_main.json
python3 scripts/gpu/step_with_kernel.py jaxk3.model:TRITON_FUSIONS=1 -- $S4 --json $OUT/s_on.json   # then both again (s_main2, s_on2)
XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/gpu/step_with_kernel.py jaxk3.model:TRITON_FUSIONS=1 -- $A --json /tmp/gc/c_on.json
python3 -c "import json; d=json.load(open('/tmp/gc/c_on.json')); print(json.dumps(d['rows'][0]['profile']['ops']))"   # 4_printed.txt's last line
