# twenty-ninth session, 2026-12-06, 1x H100 80GB HBM3, jax/jaxlib 0.11.2, Python 3.12.3 (the device image); main at 5f00ef8
# call 1 (wall 194 s)
export BS_PATCHES='gemv:ROUTER_XN=1' BS_VARIANTS=serving/auto BS_AGAIN=0 CS_PATCHES='attn_res_norm:SELECT_STACK=1 jaxk3.layers.moe:LATENT_NORM_IN_UP=1' KTEST_FILES=tests/test_gemv.py KTEST_K='router_form or fp32_row'
bash scripts/gpu_check.sh env build bf16step > $OUT/a.log 2>&1; bash scripts/gpu_check.sh cudastep > $OUT/b.log 2>&1; timeout 100 bash scripts/gpu_check.sh ktests > $OUT/c.log 2>&1
# call 2 (wall 219 s); the timeline stage cut to the 48B with command buffers on (run as a sed on the device copy; now TL_MODELS=48 TL_CB=on)
(CS_BATCH=8 CS_PATCHES='attn_res_norm:SELECT_STACK=1 jaxk3.layers.moe:LATENT_NORM_IN_UP=1;jaxk3.layers.moe:LATENT_NORM_IN_UP=1' bash scripts/gpu_check.sh build cudastep; CS_BATCH=1 CS_PATCHES='attn_res_norm:SELECT_STACK=1;jaxk3.layers.moe:LATENT_NORM_IN_UP=1' bash scripts/gpu_check.sh cudastep) > $OUT/d.log 2>&1
TL_MODELS=48 TL_CB=on TL_TIMEOUT=120 bash scripts/gpu_check.sh timeline
# call 3 (wall 88 s)
CS_BATCH=8 CS_PATCHES='attn_res_norm:SELECT_STACK=1' bash scripts/gpu_check.sh cudastep
A="--config kimi-linear-48b --layers 0-3 --experts 64 --tp 1 --context 4k --batch 1 --strategies stock --variants serving/auto --steps 10 --census"
export XLA_FLAGS=--xla_gpu_enable_command_buffer=
python3 -m jaxk3.cli bench decode $A --json $OUT/c48_main.json > $OUT/c48_main.log 2>&1
python3 scripts/gpu/step_with_kernel.py gemv:ROUTER_XN=1 -- $A --json $OUT/c48_rx.json > $OUT/c48_rx.log 2>&1
