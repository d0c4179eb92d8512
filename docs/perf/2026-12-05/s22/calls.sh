# The twenty-second session's device calls as run (docs/PERF.md, twenty-second-session section), one H200 each,
# jax 0.11.2 + CUDA 13 (the device image).  N_call.txt: each call's printed output; raw files start with the call's
# number.  Call 1 returned only its first eight files (the device tool's count limit): its other step JSONs are its
# printed rows in 1_call.txt.  Call 3 ran main at aec9648 (the new defaults); a request before it was refused.
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
G=scripts/gpu_check.sh
if [ "$C" = 1 ]; then  # main at 7679f6f
  CF_SWEEP_TIMEOUT=150 CF_TEST_TIMEOUT=180 bash $G env build cudaforms
  CS_BATCH=1 bash $G cudastep   # main, CUDA_RAW=1, CUDA_RAW=1 CUDA_DOWN=1, main again
  CS_BATCH=8 bash $G cudastep   # main, CUDA_WIDE=1, CUDA_WIDE=1 CUDA_DOWN=1, main again
fi
if [ "$C" = 2 ]; then  # with tests/test_kernels.py's `_flip_atol` tolerance
  bash $G build
  python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k cuda_wide_on_gpu
  CS_BATCH=1 CS_PATCHES='moe_experts:CUDA_L2=1' bash $G cudastep
  CS_BATCH=8 CS_PATCHES='moe_experts:CUDA_WIDE=1 moe_experts:CUDA_L2=1;moe_experts:CUDA_WIDE=1 moe_experts:CUDA_DOWN=1 moe_experts:CUDA_L2=1' \
    bash $G cudastep
  bash $G exactstep   # main, jaxk3.model:EXCESS_PRECISION=1, (main2 cut by the call's own 545 s limit)
fi
if [ "$C" = 3 ]; then  # main at aec9648: CUDA_WIDE (2-8 tokens) and CUDA_L2 on
  bash $G build
  K3S="--config k3 --layers 11-14 --experts 32 --tp 1 --context 4k --steps 20 --repeats 5 --strategies packed+sharded+one-shot --batch 8"
  python3 -m jaxk3.cli bench decode $K3S --json k3b8_new.json
  python3 scripts/gpu/step_with_kernel.py moe_experts:CUDA_WIDE=0 moe_experts:CUDA_L2=0 -- $K3S --json k3b8_old.json
  python3 -m pytest tests/test_kernels_real.py -m gpu -q -rfEs -p no:cacheprovider -k 'moe_experts_mxfp4 and 8]'
fi
