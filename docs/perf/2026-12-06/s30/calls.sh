# thirtieth session, 2026-12-06, 1x H100 80GB HBM3 (the device tool's H100 kind; no H200 came), jax/jaxlib 0.11.2,
# Python 3.12.3 (the device image)
# call 1 (wall 184.6 s; main at d0ae45a with MERGE_R in the working tree, off by default then)
bash scripts/gpu_check.sh env build > $OUT/a.log 2>&1
KTEST_FILES=tests/test_kernels.py KTEST_K=mla_decode_uv_on_gpu KTEST_TIMEOUT=150 bash scripts/gpu_check.sh ktests
MLA_ARGS='--merge' MLA_TIMEOUT=120 bash scripts/gpu_check.sh mla
#   (then an Nsight Compute stage on one 48B step: ncu crashed, rc 139; the stage was removed)
A="--config kimi-linear-48b --layers 0-3 --experts 64 --tp 1 --context 4k --batch 1 --strategies stock --variants serving/auto --steps 10 --census"
XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 -m jaxk3.cli bench decode $A --json $OUT/c48_main.json
XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/gpu/step_with_kernel.py mla_decode:MERGE_R=128 -- $A --json $OUT/c48_mr.json
# call 2 (wall 329.3 s, the same machine)
S="--config kimi-linear-48b --layers all --experts 64 --tp 1 --batch 1 --strategies stock --variants serving/auto --steps 20 --repeats 5"
python3 -m jaxk3.cli bench decode $S --context 4k --json $OUT/s4_main.json
python3 scripts/gpu/step_with_kernel.py mla_decode:MERGE_R=128 -- $S --context 4k --json $OUT/s4_mr.json
python3 -m jaxk3.cli bench decode $S --context 32k --json $OUT/s32_main.json
python3 scripts/gpu/step_with_kernel.py mla_decode:MERGE_R=128 -- $S --context 32k --json $OUT/s32_mr.json
python3 -m jaxk3.cli bench decode $S --context 4k --json $OUT/s4_main2.json
