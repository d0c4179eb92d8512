# The fifteenth session's device calls as run (docs/PERF.md, fifteenth-session section).  ENV below is
# PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92.
# Calls 1-4 ran one temporary script (CALL=N); its blocks are copied here.  Raw files start with the call's number.
# Call 1's and 4's test selections matched nothing (rc 5; call 4's real-dims node ids were dropped by its -k); call 2's
# ran the tiny cases only, for the same reason; call 5 ran the real-dims tests by node id.
# The code each call ran: call 1, main at c5e0748 (mx_dot off; the step's mx_dot patch crashed on a Bp mismatch,
# since fixed); call 2, mx_dot the MXFP4 B > 1 default at bn 64, and align with a second cumulative-sum form ("dot",
# even, not kept); call 3, the same with the K3 B = 8 entries in STEP_MEASURED (auto takes the kernel) and the
# prepare's profile; call 4, mx_dot at bn 128 and blocks_of's search as compare_all (SEARCH), A/B'd against "scan".
t() { echo "== $* ($(date -u +%T))"; }
if [ "$C" = 1 ]; then
  t tests
  timeout -k 5 100 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "moe_experts_kernel_on_gpu and mx_dot" > $O/1_mx_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" $O/1_mx_tests.log | cut -c1-300 | tail -8
  t sweep
  timeout -k 5 120 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 8 --json $O/1_sweep.json 2>&1 | cut -c1-230
  S="--config k3 --layers 11-14 --experts 32 --tp 1 --batch 8 --context 4k --strategies stock,packed+sharded+one-shot --steps 20 --repeats 5"
  t main; timeout -k 5 140 python3 -m jaxk3.cli bench decode $S --json $O/1_k3b8_main.json 2>&1 | grep -v "^  \.\. " | tail -6
  t mx; timeout -k 5 140 python3 scripts/gpu/step_with_kernel.py moe_experts moe_experts:Config.mx_dot=1 -- $S --json $O/1_k3b8_mx.json 2>&1 | grep -v "^  \.\. " | tail -6
  t align; timeout -k 5 75 python3 scripts/gpu/moe_grouped.py --align --tokens 4096 --json $O/1_align.json 2>&1 | tail -5
fi
if [ "$C" = 2 ]; then
  t tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 110 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "moe_experts_kernel_on_gpu and mxfp4 and (config0 or config4 or config5)" "$T[moe_experts_mxfp4-k3-1-8]" "$T[moe_experts_mxfp4-k3-2-8]" "$T[moe_experts_mxfp4-k3-8-8]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-8]" > $O/2_mx_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" $O/2_mx_tests.log | cut -c1-300 | tail -8
  t sweep
  timeout -k 5 170 python3 scripts/gpu/moe_experts_sweep.py --preset k3,kl --batch 8 --json $O/2_sweep.json 2>&1 | cut -c1-48,100-230
  S="--config k3 --layers 11-14 --experts 32 --tp 1 --batch 8 --context 4k --strategies stock,packed+sharded+one-shot --steps 20 --repeats 5"
  t main; timeout -k 5 100 python3 -m jaxk3.cli bench decode $S --json $O/2_k3b8_main.json 2>&1 | grep -v "^  \.\. " | grep -E "^ +8 \|"
  t kernel; timeout -k 5 100 python3 scripts/gpu/step_with_kernel.py moe_experts -- $S --json $O/2_k3b8_kernel.json 2>&1 | grep -v "^  \.\. " | grep -E "^ +8 \||Error|error" | tail -4
  t kernel bn64; timeout -k 5 100 python3 scripts/gpu/step_with_kernel.py moe_experts moe_experts:Config.bn=64 -- $S --json $O/2_k3b8_bn64.json 2>&1 | grep -v "^  \.\. " | grep -E "^ +8 \||Error|error" | tail -4
  t align; timeout -k 5 100 python3 scripts/gpu/moe_grouped.py --align --tokens 4096 --json $O/2_align.json 2>&1 | grep -v Warn | tail -6
fi
if [ "$C" = 3 ]; then
  S="--config k3 --layers 11-14 --experts 32 --tp 1 --batch 8 --context 4k --steps 20 --repeats 5"
  t main; timeout -k 5 100 python3 -m jaxk3.cli bench decode $S --strategies stock,packed+sharded+one-shot --json $O/3_k3b8_main.json 2>&1 | grep -v "^  \.\. " | grep -E "^ +8 \||rror" | tail -4
  t packed bn128; timeout -k 5 90 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.bn=128 -- $S --strategies packed+sharded+one-shot --json $O/3_k3b8_bn128.json 2>&1 | grep -v "^  \.\. " | grep -E "^ +8 \||rror" | tail -3
  t census packed
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout -k 5 120 python3 -m jaxk3.cli bench decode $S --strategies packed+sharded+one-shot --census --json $O/3_k3b8_census.json > $O/3_k3b8_census.log 2>&1
  echo "rc $?"; grep -v "^  \.\. " $O/3_k3b8_census.log | head -60 | cut -c1-200
  t prepare; timeout -k 5 100 python3 scripts/gpu/moe_grouped.py --align --tokens 4096 --json $O/3_align.json 2>&1 | grep -v Warn | tail -24
fi
if [ "$C" = 4 ]; then
  t tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 90 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "moe_experts_kernel_on_gpu and mxfp4 and config0" "$T[moe_experts_mxfp4-k3-1-8]" "$T[moe_experts_mxfp4-k3-2-8]" "$T[moe_experts_mxfp4-k3-8-8]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-8]" > $O/4_mx_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" $O/4_mx_tests.log | cut -c1-300 | tail -8
  S="--config k3 --layers 11-14 --experts 32 --tp 1 --batch 8 --context 4k --steps 20 --repeats 5 --strategies packed+sharded+one-shot"
  t main; timeout -k 5 80 python3 -m jaxk3.cli bench decode $S --json $O/4_k3b8_main.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t without; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py -moe_experts -- $S --json $O/4_k3b8_without.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t prepare; timeout -k 5 110 python3 scripts/gpu/moe_grouped.py --align --tokens 4096 --json $O/4_align.json 2>&1 | grep -v Warn | grep -v "op = " | tail -14
  G="--config kimi-linear-48b --tp 1 --batch 1 --prompt 4096 --new 32 --experts 64"
  t generate; timeout -k 5 120 python3 -m jaxk3.cli bench generate $G --json $O/4_gen_main.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t generate scan; timeout -k 5 120 python3 scripts/gpu/step_with_kernel.py moe_grouped:SEARCH=scan -- generate $G --json $O/4_gen_scan.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
fi
# call 5 (ENV)
T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
python3 -m pytest -m gpu -q "$T[moe_experts_mxfp4-k3-1-8]" "$T[moe_experts_mxfp4-k3-2-8]" "$T[moe_experts_mxfp4-k3-8-8]" \
  "$T[moe_experts_mxfp4-kimi-linear-48b-1-8]" "$T[moe_experts-k3-1-8]"                      # 5_real_tests.log
python3 -m pytest tests/test_kernels.py -m gpu -q -k "moe_experts_kernel_on_gpu and mxfp4 and None"   # 5_tiny_tests.log
# call 6 (ENV; main at the PERF commit, the sweep's --formats/--configs new): the tensor-core form's tiles around bn 128
python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 8 --formats mxfp4 \
  --configs "bn=256;bn=128,bk=256;bn=128,num_warps=8;bn=256,num_warps=8;bn=128,num_stages=4;bn=128,bk=64" --json $OUT/6_sweep.json
