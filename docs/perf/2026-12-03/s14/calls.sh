# The fourteenth session's device calls as run (docs/PERF.md, fourteenth-session section).  ENV below is
# PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92.
# call 1 (main at 95bab09; ran out of its 600 s before the last row and the AGAIN rows)
T_TIMEOUT=200 S_TIMEOUT=100 TEST_FILES="tests/test_kernels.py tests/test_gemv.py" TEST_K="streaming_forms_on_gpu" AB="moe_experts:Config.x_row=1@1 moe_experts:Config.x_row=1+moe_experts:Config.joint=1@1 moe_experts:Config.x_row=1+moe_experts:Config.joint=1+moe_experts:Config.ahead=1@1 moe_experts:Config.x_row=1+moe_experts:Config.ahead=1@1 gemv:X_ROW=1+gemv:NORM_EARLY=1+gemv:GNORM_EARLY=1@1 gemv:X_ROW=1+gemv:NORM_EARLY=1+gemv:AHEAD=1@1" AGAIN=1 bash scripts/gpu/ab_call.sh
# call 2 (ENV; the test selection matched nothing: rc 5; five of six determinism runs hit the 60 s limit)
OUT=$OUT DET_RUNS=6 DET_TIMEOUT=60 bash scripts/gpu_check.sh determinism
timeout -k 5 90 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "moe_experts_kernel_on_gpu and group"
timeout -k 5 120 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --json $OUT/moe_experts_sweep.json
# call 3 (ENV)
timeout -k 5 100 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "moe_experts_kernel_on_gpu and config2"
S="--config k3 --layers 11-14 --experts 32 --tp 1 --batch 1 --context 4k --strategies packed+sharded+one-shot --steps 20 --repeats 5"
python3 -m jaxk3.cli bench decode $S --json $OUT/k3_main.json
python3 scripts/gpu/step_with_kernel.py moe_experts moe_experts:Config.scale=group moe_experts:Config.x_f32=1 -- $S --json ...
python3 scripts/gpu/step_with_kernel.py moe_experts -- $S --json $OUT/k3_moe_experts.json
# call 4 (ENV; main at its second commit: the scale per group the B = 1 default)
T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
python3 -m pytest "$T[moe_experts_mxfp4-k3-1-1]" "$T[moe_experts_mxfp4-k3-2-1]" "$T[moe_experts_mxfp4-k3-8-1]" -m gpu -q
python3 -m jaxk3.cli bench decode $S --json $OUT/k3_main_<t>.json       # main, then without it, then main again
python3 scripts/gpu/step_with_kernel.py -moe_experts -- $S --json $OUT/k3_without.json
# call 5 (ENV)
DET_RUNS=3 DET_TIMEOUT=80 DET_FLAGS="- --xla_gpu_exclude_nondeterministic_ops=true -" bash scripts/gpu_check.sh determinism
