#!/usr/bin/env bash
# On a machine with >= 2 NVIDIA GPUs: build the extension with its CUDA handlers against this
# machine's own jax, print the machine, run the GPU tests, benchmark the gathers (xla_floor /
# ffi_floor / lax / ffi in the same run) with XLA command buffers on (default) and off, and
# benchmark the decode step of K3 layers 11-14 at real dimensions (three latent strategies).
#
#   scripts/gpu_check.sh [env] [build] [test] [thunks] [bench] [decode] [decode_cb] [census] [bench_off] [generate] [kernels]
#                        [gemvfused] [ktests] [kreal] [step48] [census48] [grouped] [attn] [kda] [chunks] [breakdown]
#                        [mxfp4] [moestep] [targets] [mla] [hostcopy] [determinism] [cudaforms] [cudastep] [cudancu]
#                        [exactstep] [cudastream] [moeblock] [bf16step] [bf16gen] [timeline] [groupedncu] [readfloor]
#   (no argument: env build test thunks bench decode decode_cb census bench_off; `bench` is command buffers on, `bench_off` off; `census`
#   is the kernel census of the Kimi-Linear-48B decode step; `generate` is the prefill + decode loop at
#   Kimi-Linear-48B dimensions on one GPU, GEN_ARGS to change it; `kernels` (one GPU is enough):
#   the Pallas kernels' compiled tests, `bench kernels`, and K3 layers 11-14 stock vs packed+sharded
#   with kernels off and on; `gemvfused` the GEMV at the fused shapes vs XLA; `ktests` the compiled kernel
#   tests at real dims (KTEST_FILES, KTEST_K a -k expression); `kreal` each kernel vs XLA at real dims; `step48` the Kimi-Linear-48B step, main's
#   (checkpoint layout, kernels off) vs the serving layout with kernels=auto; `census48` its kernel census;
#   `grouped` the prefill MoE's grouped-GEMM kernels (compiled tests, then timed against the dense form,
#   ragged_dot and a GEMM of the same FLOPs at Kimi-Linear-48B dims); `attn` the prefill's MLA kernel and KDA form
#   against the paths they replace; `kda` KDA's prefill forms inside 48B's first four layers with their longest kernels;
#   `mxfp4` the MoE decode experts kernel's compiled tests and its configurations against XLA (Kimi-Linear-48B
#   serving layout with the shared experts, K3 TP 2 share); `moestep` the 48B step with that kernel patched in;
#   `targets` issue 22's 32K-context and K3-layers figures (one GPU); `mla` the MLA decode attention's tilings
#   against XLA at 48B dims, 4K and 32K (scripts/gpu/mla_sweep.py; MLA_ARGS=--merge the merge's two forms,
#   --heads one group of 32 heads by split); `hostcopy` Model.score's host path alone;
#   `determinism` the 48B step's first greedy tokens in DET_RUNS processes (XLA as it is, autotuning off, deterministic
#   ops only, in turn), each with its top-2 margins and whether its check steps rerun bitwise (PERF.md, 13th session);
#   `cudaforms` the MXFP4 CUDA kernels' compiled tests and their forms alone at K3's TP 2 share (B 1 and 8), `cudastep`
#   the K3 layers 11-14 step at CS_BATCH (1) with them patched in (CS_PATCHES), main before and after, and with
#   CS_CENSUS (a patch list; "-" for none) the step's census; `cudancu` Nsight Compute on them (NCU_BATCH, NCU_CONFIG);
#   `exactstep` the 48B B = 1 step as main compiles it (the bf16 roundings kept) against XLA's default precision
#   (`jaxk3.model:EXCESS_PRECISION=1`), main again after (one process each); `cudastream` the MXFP4 CUDA kernels'
#   streaming form (`cuda_stages`, twenty-third session; main's since the twenty-seventh): its compiled tests, alone at
#   K3's TP 2 share (B 1 and 8) against the register form (then the steps: `cudastep`, the register form by default); `moeblock` the 48B's MoE block at one token
#   (bf16 experts) in XLA and through the Pallas kernels against float64, its errors printed; `bf16step` the 48B B = 1
#   step, main / BS_PATCHES (none by default) / main again; `bf16gen` its `bench generate` (B = 1), main / BG_PATCHES;
#   `readfloor` one read-only XLA kernel's rate at the step's sizes; `timeline` how busy the GPU is over back-to-back 48B B = 1 and K3 B = 1 steps, command buffers on and off;
#   `groupedncu` Nsight Compute on the prefill's grouped-GEMM kernels and the plain GEMM of the same FLOPs.
#   On one GPU: `scripts/gpu_check.sh env gemvfused ktests step48 generate`)
#
# Logs go to $OUT (default ./out/gpu).  No network: pip builds with --no-build-isolation
# --no-deps, so scikit-build-core, nanobind, cmake, nvcc and jax must be installed already.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
STAGES=${*:-env build test thunks bench decode decode_cb census bench_off}
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export JAX_PLATFORMS=cuda
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Without preallocation XLA's allocator still stops at MEM_FRACTION of the GPU (0.75 by default): 99 GiB
# of an H200's 132, too little for Kimi-Linear-48B's 91.5 GiB of weights (all 256 experts) and a 4K-token
# prefill chunk's 10.4 GiB of temporaries (measured: OOM at 0.75).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-.92}
export JAXK3_GATHER_TIMEOUT_S=${JAXK3_GATHER_TIMEOUT_S:-20}
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
# Nsight Compute (the device image has it in the CUDA toolkit, not always on PATH) and the warp-stall metrics both ncu
# stages read
ncu_bin() { which ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1; }
NCU_STALLS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'

if has env; then
  {
    date -u; uname -a
    nvidia-smi || true
    nvidia-smi topo -m || true
    nvcc --version | tail -2 || true
    $PY -c "import sys, jax, jaxlib; print('python', sys.version.split()[0]); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())"
    $PY -m pip list 2>/dev/null | grep -Ei '^(jax|jaxlib|jax-cuda|nanobind|scikit-build|cmake|numpy) ' || true
  } 2>&1 | tee "$OUT/env.txt"
fi

if has build; then
  echo "== build ($(date -u +%T))"
  JAXK3_CUDA=ON JAXK3_CUDA_ARCHS=${JAXK3_CUDA_ARCHS:-90} timeout 300 \
    $PY -m pip install -v --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1
  rc=$?
  tail -5 "$OUT/build.log"
  if [ $rc -ne 0 ]; then echo "BUILD FAILED ($rc)"; grep -E "error|Error" "$OUT/build.log" | head -30; exit 1; fi
  $PY -c "from jaxk3 import _ffi; print(_ffi.build_info()); print('cuda_group_ok', _ffi.cuda_group_ok([0, 1]))"
fi

if has test; then
  echo "== tests ($(date -u +%T))"
  timeout 300 $PY -m pytest tests/test_gpu_gathers.py tests/test_kernels.py -m gpu -v -rs -x -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed|error" | tail -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has thunks; then
  echo "== is the custom call inside a command buffer? ($(date -u +%T))"
  rm -rf /tmp/jaxk3_xdump
  XLA_FLAGS="--xla_dump_to=/tmp/jaxk3_xdump" timeout 120 $PY - <<'EOF' 2>&1 | tee "$OUT/thunks.txt"
import glob, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxk3 import collectives as C
devs = jax.devices()[:2]
mesh = jax.sharding.Mesh(np.asarray(devs), ("tp",))
def body(x):
    for i in range(4):
        g = C.all_gather(x, "tp", axis=1, tiled=True, impl="ffi")
        x = g[:, 256:512] * 1.5
    return x
f = jax.jit(C.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
x = jax.device_put(jnp.ones((2, 256), jnp.float32), NamedSharding(mesh, P("tp")))
print(np.asarray(f(x))[0, :4])
for path in sorted(glob.glob("/tmp/jaxk3_xdump/*thunk_sequence*")):
    txt = open(path).read()
    if "jaxk3" in txt or "custom" in txt.lower():
        print(path.split("/")[-1], "kCommandBuffer:", txt.count("kCommandBuffer"), "custom-call lines:",
              sum("jaxk3" in l for l in txt.splitlines()))
        print("\n".join(l for l in txt.splitlines() if "CommandBuffer" in l or "jaxk3" in l or "CustomCall" in l)[:3000])
EOF
fi

bench() {  # $1 = label, XLA_FLAGS from the environment
  timeout ${BENCH_TIMEOUT:-200} $PY -m jaxk3.cli bench gather ${BENCH_ARGS:-} --json "$OUT/bench_$1.json" 2>&1 | tee "$OUT/bench_$1.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

if has bench; then
  echo "== bench, command buffers on (XLA default) ($(date -u +%T))"
  bench cb_on
fi

if has decode; then
  # K3 layers 11-14 (MLA, KDA, KDA, KDA, all MoE; AttnRes block starts at 12), 32 routed experts,
  # TP over 2 GPUs, stock / sharded+lax / sharded+one-shot in one process.
  echo "== decode step, K3 dims ($(date -u +%T))"
  timeout ${DECODE_TIMEOUT:-300} $PY -m jaxk3.cli bench decode --config k3 --layers 11-14 --experts 32 --tp 2 \
    --batch 1,8 --context 4k,32k --json "$OUT/decode.json" --plot "$OUT/decode.png" --hlo-dir /tmp/jaxk3_decode_hlo \
    2>&1 | tee "$OUT/decode.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  tar -C /tmp -czf "$OUT/decode_hlo.tgz" jaxk3_decode_hlo 2>/dev/null || true
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv 2>&1 | tee -a "$OUT/decode.log"
fi

if has decode_cb; then
  # Batch 1, 4K: the same step with command buffers off, then on with the thunk sequence dumped
  # (how many kernels a step launches, and how many of them run inside CUDA graphs).
  D="--config k3 --layers 11-14 --experts 32 --tp 2 --batch 1 --context 4k --copy-mb 512"
  echo "== decode step B=1, command buffers off ($(date -u +%T))"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout 200 $PY -m jaxk3.cli bench decode $D \
    --json "$OUT/decode_cb_off.json" 2>&1 | tee "$OUT/decode_cb_off.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "== decode step B=1, thunk sequence ($(date -u +%T))"
  rm -rf /tmp/jaxk3_ddump
  XLA_FLAGS="--xla_dump_to=/tmp/jaxk3_ddump --xla_dump_hlo_module_re=.*step.*" timeout 200 $PY -m jaxk3.cli \
    bench decode $D --strategies stock,sharded+one-shot --steps 5 --repeats 2 >"$OUT/decode_dump.log" 2>&1
  $PY - <<'EOF' 2>&1 | tee "$OUT/decode_thunks.txt"
import collections, glob, re
files = sorted(glob.glob("/tmp/jaxk3_ddump/*thunk_sequence_after_thunk_passes*"))
for path in files:
    txt = open(path).read()
    kinds = collections.Counter(re.findall(r"\bk[A-Z][A-Za-z0-9]+", txt))
    print(path.split("/")[-1], "lines", txt.count("\n"), dict(kinds.most_common(16)))
if files:
    print(open(files[0]).read()[:4000])
EOF
fi

if has census; then
  # Kernels per block (embed, each layer's attention and ffn, head) by kind from the compiled step's
  # HLO, and device time per block from a profile: Kimi-Linear-48B, all 27 layers, B=1, 4K context,
  # TP 2, one strategy.  Command buffers off, so that each kernel's profile event names its own op
  # (inside a CUDA graph it carries the graph's name); the kernel counts are the same either way.
  # 32 routed experts (memory; a step reads the top-8 only, so the kernels are the same).
  echo "== kernel census, Kimi-Linear-48B decode step ($(date -u +%T))"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout ${CENSUS_TIMEOUT:-300} $PY -m jaxk3.cli bench decode \
    --config kimi-linear-48b --layers all --experts 32 --tp 2 --batch 1 --context 4k --strategies sharded+one-shot \
    --steps 10 --census --json "$OUT/census.json" 2>&1 | tee "$OUT/census.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has generate; then
  # What a user feels: chunked prefill of a 4096-token prompt and 256 new tokens from the decode
  # loop on the device, beside the back-to-back step rate and the bandwidth floor (one GPU).
  echo "== generate, Kimi-Linear-48B dims ($(date -u +%T))"
  timeout ${GEN_TIMEOUT:-400} $PY -m jaxk3.cli bench generate --config kimi-linear-48b --tp 1 --batch 1,8 \
    --prompt 4096 --new 256 ${GEN_ARGS:-} --json "$OUT/generate.json" --plot "$OUT/generate.png" 2>&1 | tee "$OUT/generate.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has kernels; then
  echo "== device kernels: compiled tests ($(date -u +%T))"
  timeout ${KTEST_TIMEOUT:-300} $PY -m pytest tests/test_kernels.py -m gpu -v -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/kernels_tests.log" | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed|error" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "== device kernels against the XLA path, K3 at TP 2 per rank ($(date -u +%T))"
  timeout ${KBENCH_TIMEOUT:-300} $PY -m jaxk3.cli bench kernels --config k3 --tp 2 --experts 64 --batch 1,8 \
    --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "== K3 layers 11-14, one GPU: stock vs packed experts + sharded latents, kernels off / on ($(date -u +%T))"
  timeout ${KDECODE_TIMEOUT:-400} $PY -m jaxk3.cli bench decode --config k3 --layers 11-14 --experts 32 --tp 1 \
    --batch 1,8 --context 4k --strategies stock,packed+sharded+one-shot --kernels off,on \
    --json "$OUT/decode_kernels.json" 2>&1 | tee "$OUT/decode_kernels.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has gemvfused; then
  # The GEMV at the serving layout's fused shapes: XLA's dot vs the kernel's configs, same run
  # (scripts/gpu/gemv_sweep.py; the budget bounds the sweep, XLA and the first config always run).
  echo "== gemv, fused shapes: XLA vs kernel ($(date -u +%T))"
  timeout -k 10 ${PICK_TIMEOUT:-150} $PY scripts/gpu/gemv_sweep.py --no-cuda --budget ${GEMV_BUDGET:-90} \
    --cases ${GEMV_CASES:-kl_kda_in,kl_mla_in,kl_shared_gu,k3_kda_in_tp8,k3_mla_in_tp8} --json "$OUT/gemv_pick.json" \
    > "$OUT/gemv_pick.log" 2>&1
  echo "gemv pick rc $?"; sed -n '/# GEMV summary/,$p' "$OUT/gemv_pick.log" | cut -c1-160
fi

if has ktests; then
  echo "== compiled kernel tests at real dims ($(date -u +%T))"
  timeout -k 10 ${KTEST_TIMEOUT:-200} $PY -m pytest ${KTEST_FILES:-tests/test_kernels_real.py tests/test_gemv.py} -m gpu -q -rfEs \
    -p no:cacheprovider ${KTEST_ARGS:-} ${KTEST_K:+-k "$KTEST_K"} > "$OUT/ktests.log" 2>&1
  echo "ktests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/ktests.log" | cut -c1-300 | tail -20
fi

if has kreal; then
  echo "== kernels at real dims vs XLA ($(date -u +%T))"
  timeout -k 10 ${KR_TIMEOUT:-150} $PY scripts/gpu/kernels_real.py --json "$OUT/kernels_real.json" ${KR_ARGS:-} \
    > "$OUT/kernels_real.log" 2>&1
  echo "kernels_real rc $?"; sed -n '/# kernels vs XLA/,$p' "$OUT/kernels_real.log" | cut -c1-150
fi

if has grouped; then
  # The prefill MoE's grouped-GEMM kernels: compiled tests (tiny and real dims), then the kernel against
  # the dense form, ragged_dot and a plain GEMM of the same FLOPs at Kimi-Linear-48B dims, 256 experts.
  echo "== moe_grouped: compiled tests, then vs dense / ragged_dot / GEMM peak ($(date -u +%T))"
  timeout -k 10 ${GT_TIMEOUT:-150} $PY -m pytest tests/test_kernels.py tests/test_kernels_real.py -m gpu -k grouped -q -rfEs \
    -p no:cacheprovider > "$OUT/grouped_tests.log" 2>&1
  echo "grouped tests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/grouped_tests.log" | cut -c1-300 | tail -20
  timeout -k 10 ${GB_TIMEOUT:-240} $PY scripts/gpu/moe_grouped.py --json "$OUT/moe_grouped.json" ${GB_ARGS:-} 2>&1 | cut -c1-200
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has attn; then
  # The prefill's attention blocks: mla_prefill's compiled tests, then KDA's chunked form (before / now) and
  # MLA's attention (XLA / the kernel's configs) at Kimi-Linear-48B dims (scripts/gpu/prefill_attention.py).
  echo "== prefill attention: compiled tests, then vs the replaced paths ($(date -u +%T))"
  timeout -k 10 ${AT_TIMEOUT:-150} $PY -m pytest tests/test_kernels.py -m gpu -k "${AT_K:-kda_prefill or mla_prefill}" -v -rfEs \
    -p no:cacheprovider > "$OUT/attn_tests.log" 2>&1
  echo "attn tests rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/attn_tests.log" | cut -c1-300 | tail -20
  timeout -k 10 ${AB_TIMEOUT:-240} $PY scripts/gpu/prefill_attention.py --json "$OUT/prefill_attention.json" ${AB_ARGS:-} \
    2>&1 | cut -c1-220
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has kda; then
  # KDA's prefill inside the model: 48B's first four layers (three KDA, one MLA), 64 experts, a 4096-token
  # prompt, each form of the delta rule, the longest kernels of each (prefill_breakdown.py --top).
  for form in ${KDA_FORMS:-kernel scan}; do
    echo "== KDA prefill in the model, form $form ($(date -u +%T))"
    XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout -k 10 ${KDA_TIMEOUT:-150} $PY scripts/gpu/prefill_breakdown.py \
      --config kimi-linear-48b --layers 0-3 --experts 64 --kda-form $form --top 14 --json "$OUT/kda_$form.json" 2>&1 \
      | grep -v "Warning\|warn" | tee "$OUT/kda_$form.log" | cut -c1-200
  done
fi

if has mxfp4; then
  # The MoE decode experts kernel (moe_experts): its compiled tests with the decodes and tilings, then its
  # configurations against XLA at 48B (serving layout, shared experts fused) and K3's TP 2 share, bf16 and
  # MXFP4 (scripts/gpu/moe_experts_sweep.py; issue 22).
  echo "== moe_experts: compiled tests, then configs vs XLA ($(date -u +%T))"
  timeout -k 10 ${MX_TIMEOUT:-150} $PY -m pytest tests/test_kernels.py tests/test_kernels_real.py -m gpu -k moe_experts -v -rfEs \
    -p no:cacheprovider > "$OUT/mxfp4_tests.log" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  echo "moe_experts tests rc $rc"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/mxfp4_tests.log" | cut -c1-200 | tail -30
  timeout -k 10 ${MS_TIMEOUT:-300} $PY scripts/gpu/moe_experts_sweep.py --json "$OUT/moe_experts_sweep.json" ${MS_ARGS:-} 2>&1 \
    | cut -c1-220
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has moestep; then
  # The Kimi-Linear-48B decode step with the moe_experts kernel taken wherever it fits (registry patched in that
  # process: scripts/gpu/step_with_kernel.py; MOESTEP_PATCH=-moe_experts: left out), beside step48's serving/auto.
  echo "== 48B step, serving/auto, patched: ${MOESTEP_PATCH:-moe_experts} ($(date -u +%T))"
  timeout -k 10 ${MOESTEP_TIMEOUT:-200} $PY scripts/gpu/step_with_kernel.py ${MOESTEP_PATCH:-moe_experts} -- --config kimi-linear-48b \
    --layers all --experts 64 --tp 1 --batch ${MOESTEP_BATCH:-1,8} --context 4k --strategies stock --variants serving/auto \
    --steps 20 --repeats 5 --json "$OUT/moestep.json" 2>&1 | grep -v "^  \.\. " | tee "$OUT/moestep.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has mla; then
  # The MLA decode attention (mla_decode_uv) in its tilings against XLA's path, 48B dims, 4K and 32K (one GPU).
  echo "== mla_decode_uv tilings, Kimi-Linear-48B MLA ($(date -u +%T))"
  timeout -k 10 ${MLA_TIMEOUT:-300} $PY scripts/gpu/mla_sweep.py --json "$OUT/mla_sweep.json" ${MLA_ARGS:-} \
    > "$OUT/mla_sweep.log" 2>&1
  echo "mla_sweep rc $?"; sed -n '/# per (S, B)/,$p' "$OUT/mla_sweep.log" | cut -c1-150
fi

if has hostcopy; then
  # Model.score's host path alone: the output's threaded first touch, then the pinned slices placed by threads.
  echo "== score's host copy ($(date -u +%T))"
  timeout -k 10 ${HC_TIMEOUT:-120} $PY scripts/gpu/host_copy.py ${HC_ARGS:---score-only} 2>&1 | tee "$OUT/host_copy.log"
fi

if has readfloor; then
  # What one read-only XLA kernel streams at the decode step's sizes (10.6 MB to 755 MB, scripts/gpu/read_floor.py):
  # the rate the step's kernels are held to, beside the copy bandwidth of the bench's floor (thirty-eighth session).
  echo "== read-only kernels at the step's sizes ($(date -u +%T))"
  timeout -k 10 ${RF_TIMEOUT:-200} $PY scripts/gpu/read_floor.py --json "$OUT/read_floor.json" 2>&1 | tail -8
fi

if has chunks; then
  # The prefill's time against its chunk (the auto pick marked) and Model.score, Kimi-Linear-48B, 256 experts.
  echo "== prefill vs chunk, Kimi-Linear-48B ($(date -u +%T))"
  timeout -k 10 ${CH_TIMEOUT:-400} $PY scripts/gpu/prefill_chunks.py --json "$OUT/prefill_chunks.json" ${CH_ARGS:-} 2>&1 \
    | grep -v "^  \.\. " | tee "$OUT/prefill_chunks.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has breakdown; then
  # The prefill's device time by block (bench generate --breakdown alone), 48B, 64 experts kept (a short call).
  echo "== prefill by block, Kimi-Linear-48B ($(date -u +%T))"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout -k 10 ${BD_TIMEOUT:-200} $PY scripts/gpu/prefill_breakdown.py \
    --experts ${BD_EXPERTS:-64} --json "$OUT/prefill_breakdown.json" ${BD_ARGS:-} 2>&1 | tee "$OUT/prefill_breakdown.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has step48; then
  # Kimi-Linear-48B, all 27 layers (64 routed experts kept for memory; a step reads its top-8 per token),
  # TP 1, 4K: main's step (checkpoint layout, every kernel off) against the serving layout with
  # kernels=auto, same weights, same run.
  echo "== decode step, Kimi-Linear-48B, checkpoint/off vs serving/auto ($(date -u +%T))"
  timeout ${STEP_TIMEOUT:-420} $PY -m jaxk3.cli bench decode --config kimi-linear-48b --layers all --experts 64 \
    --tp 1 --batch ${STEP_BATCH:-1,8} --context 4k --strategies stock --variants ${STEP_VARIANTS:-checkpoint/off,serving/auto} \
    --steps 20 --repeats 5 --json "$OUT/step48.json" 2>&1 | grep -v "^  \.\. " | tee "$OUT/step48.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has determinism; then
  # Do processes decode the same tokens from the same seeded weights and cache?  XLA_FLAGS taken in turn from
  # DET_FLAGS ('-' for none): as XLA autotunes, with its autotuning off, and autotuning only deterministic algorithms (an
  # autotuned GEMM with a split-K of atomics would differ between runs).  Per process: the tokens, the top-2 logit
  # margins and bench decode's `rerun_equal` (the check steps again in the same process).
  flags_list=(${DET_FLAGS:-- --xla_gpu_autotune_level=0 --xla_gpu_exclude_nondeterministic_ops=true})
  echo "== determinism: ${DET_RUNS:-6} processes, XLA_FLAGS in turn: ${flags_list[*]} ($(date -u +%T))"
  D="--config kimi-linear-48b --layers all --experts 64 --tp 1 --context 4k --strategies stock --variants serving/auto --steps 2 --repeats 1 --batch ${DET_BATCH:-1}"
  for i in $(seq 1 ${DET_RUNS:-6}); do
    flags=${flags_list[$(( (i - 1) % ${#flags_list[@]} ))]}; [ "$flags" = - ] && flags=
    XLA_FLAGS="$flags" timeout -k 10 ${DET_TIMEOUT:-120} $PY -m jaxk3.cli bench decode $D --json "$OUT/det_$i.json" > "/tmp/det_$i.log" 2>&1 \
      || { echo "run $i failed"; tail -5 "/tmp/det_$i.log"; status=1; continue; }
    $PY -c "import json, sys; r = json.load(open(sys.argv[1]))['rows'][0]; print('run', sys.argv[2], 'XLA_FLAGS', repr(sys.argv[3]), 'tokens', r['tokens'], 'margins', [round(m, 6) for m in r['top2_margin']], 'rerun_equal', r['rerun_equal'])" \
      "$OUT/det_$i.json" "$i" "$flags"
  done
fi

if has targets; then
  # Issue 22's targets that no other stage re-measures, each in its own process, after step48's 4K figures:
  # the 48B step at 32K context (B = 1, serving/auto), and K3 layers 11-14 at TP 1 on one GPU (32 experts kept,
  # stock vs packed MXFP4 experts, B = 1 and 8, kernels auto).  `generate` gives the decode tokens/s target.
  echo "== decode step, Kimi-Linear-48B, 32K context ($(date -u +%T))"
  timeout ${TARGET_TIMEOUT:-300} $PY -m jaxk3.cli bench decode --config kimi-linear-48b --layers all --experts 64 \
    --tp 1 --batch 1 --context 32k --strategies stock --variants serving/auto --steps 20 --repeats 5 \
    --json "$OUT/step48_32k.json" 2>&1 | grep -v "^  \.\. " | tee "$OUT/step48_32k.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "== decode step, K3 layers 11-14, TP 1, stock vs packed ($(date -u +%T))"
  timeout ${TARGET_TIMEOUT:-300} $PY -m jaxk3.cli bench decode --config k3 --layers 11-14 --experts 32 --tp 1 \
    --batch 1,8 --context 4k --strategies stock,packed+sharded+one-shot --json "$OUT/k3_tp1.json" 2>&1 | grep -v "^  \.\. " \
    | tee "$OUT/k3_tp1.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has census48; then
  echo "== kernel census, Kimi-Linear-48B, serving/auto ($(date -u +%T))"
  rm -rf /tmp/jaxk3_census_hlo  # a reused machine's earlier HLO must not ship with this run's
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout ${CENSUS_TIMEOUT:-300} $PY -m jaxk3.cli bench decode \
    --config kimi-linear-48b --layers ${CENSUS_LAYERS:-all} --experts 64 --tp 1 --batch ${CENSUS_BATCH:-1} --context 4k \
    --strategies stock --variants ${CENSUS_VARIANTS:-serving/auto} --steps 10 --census --json "$OUT/census48.json" \
    --hlo-dir /tmp/jaxk3_census_hlo 2>&1 | tee "$OUT/census48.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # the compiled step's optimized HLO, whose fusion names the census's per-op times use
  tar -C /tmp -czf "$OUT/census48_hlo.tgz" jaxk3_census_hlo 2>/dev/null || true
fi

# An MXFP4 CUDA kernel form's compiled tests (pytest -k $2, within $3 s), then its configurations alone at K3's TP 2
# share against main's defaults and XLA, at one token ($5) and at 8 ($6), each sweep within $4 s; logs named $1.
mxfp4_forms() {
  local name=$1 tk=$2 tt=$3 st=$4 c1=$5 c8=$6
  timeout -k 10 "$tt" $PY -m pytest tests/test_kernels.py -m gpu -k "$tk" -q -rfEs -p no:cacheprovider \
    > "$OUT/${name}_tests.log" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  echo "tests rc $rc"; grep -E "^(FAILED|ERROR)|passed|failed|rror|Mismatch" "$OUT/${name}_tests.log" | cut -c1-300 | tail -12
  for b in 1 8; do
    local cf=$c1; [ $b = 8 ] && cf=$c8
    timeout -k 10 "$st" $PY scripts/gpu/moe_experts_sweep.py --preset k3 --batch $b --formats mxfp4 --configs "$cf" \
      --json "$OUT/${name}_sweep_b$b.json" 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
}

if has cudaforms; then
  # The MXFP4 CUDA kernels' forms (issue 22; queued since the twentieth session, docs/PERF.md): the compiled tests
  # (kernel 2 in CUDA, the raw, L2 and wide forms bitwise against the measured one, the wide form at 2, 5, 8 tokens),
  # then K3's TP 2 share alone in each form against the defaults and XLA, at one token and at 8 (`build` first).
  echo "== CUDA MXFP4 kernels: compiled tests, then their forms alone ($(date -u +%T))"
  mxfp4_forms cudaforms "cuda_down or cuda_gate_up or cuda_wide" "${CF_TEST_TIMEOUT:-240}" "${CF_SWEEP_TIMEOUT:-200}" \
    "${CF_CONFIGS:-cuda=0;cuda_raw=1;cuda_l2=1;cuda_wide=1;cuda_down=1;cuda_down=1,cuda_raw=1;cuda_down=1,cuda_wide=1;cuda_down=1,cuda_raw=1,cuda_l2=1}" \
    "${CF_CONFIGS8:-cuda_wide=1;cuda_wide=1,cuda_down=1;cuda_wide=1,cuda_down=1,cuda_l2=1;cuda=0,cuda_wide=1,cuda_down=1}"
fi

if has cudastep; then
  # K3 layers 11-14, packed, at CS_BATCH tokens: main's defaults against the forms patched in, one process each
  # (CS_PATCHES: ';'-separated step_with_kernel.py patch lists), main again at the end.
  b=${CS_BATCH:-1}
  K3S="--config k3 --layers 11-14 --experts 32 --tp 1 --context 4k --steps 20 --repeats 5 --strategies packed+sharded+one-shot --batch $b"
  # (default patch: kernel 1's register form, main's before its streaming form became the default, twenty-seventh
  # session; each patch's JSON is numbered by its place in CS_PATCHES, so that a patch given twice keeps both runs)
  if [ "$b" = 1 ]; then dflt="moe_experts:CUDA_STAGES=0"
  else dflt="moe_experts:CUDA_STAGES_WIDE=0"; fi
  IFS=';' read -ra patches <<< "${CS_PATCHES:-$dflt}"
  [ "${CS_PATCHES:-}" = none ] && patches=()
  echo "== K3 B = $b step: main ($(date -u +%T))"
  timeout -k 5 110 $PY -m jaxk3.cli bench decode $K3S --json "$OUT/cudastep_b${b}_main.json" 2>&1 | grep -E "^ +$b \||rror" | tail -3
  i=0
  for pt in "${patches[@]}"; do
    i=$((i + 1))
    echo "== K3 B = $b step: $pt ($(date -u +%T))"
    # shellcheck disable=SC2086
    timeout -k 5 110 $PY scripts/gpu/step_with_kernel.py $pt -- $K3S \
      --json "$OUT/cudastep_b${b}_${i}_${pt//[^A-Za-z0-9]/_}.json" 2>&1 | grep -E "^ +$b \||rror" | tail -3
  done
  echo "== K3 B = $b step: main again ($(date -u +%T))"
  timeout -k 5 110 $PY -m jaxk3.cli bench decode $K3S --json "$OUT/cudastep_b${b}_main2.json" 2>&1 | grep -E "^ +$b \||rror" | tail -3
  if [ -n "${CS_CENSUS:-}" ]; then  # where the step's time goes, per block (command buffers off), with CS_CENSUS's patches
    echo "== K3 B = $b census: ${CS_CENSUS} ($(date -u +%T))"
    if [ "$CS_CENSUS" = "-" ]; then run="$PY -m jaxk3.cli bench decode"; else run="$PY scripts/gpu/step_with_kernel.py $CS_CENSUS --"; fi
    # shellcheck disable=SC2086
    XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout -k 5 150 $run ${K3S/--steps 20 --repeats 5/--steps 10} --census \
      --json "$OUT/cudastep_b${b}_census.json" 2>&1 | grep -v "^  \.\. " | tee "$OUT/cudastep_b${b}_census.log" | tail -25
  fi
fi

if has cudastream; then
  # The CUDA kernels' streaming form (moe_experts.Config.cuda_stages 4, 6, 8; kernel 2 with cuda_down, one token): the
  # compiled tests (kernel 1 bitwise against the register form, the persistent CTAs capped to take many items), then
  # alone at K3's TP 2 share against main (kernel 1 streaming: 4 stages at one token, 8 in the wide form), its register
  # form (cuda_stages=0) and XLA, one token (kernel 1 alone, also read through L1: the wide instance; both kernels,
  # and the register CUDA kernel 2) and 8 (kernel 1).
  echo "== the CUDA kernels' streaming form: compiled tests, then alone ($(date -u +%T))"
  mxfp4_forms cudastream "cuda_stream or stream_items" "${SF_TEST_TIMEOUT:-200}" "${SF_SWEEP_TIMEOUT:-150}" \
    "${SF_CONFIGS:-cuda_stages=0;cuda_stages=4;cuda_stages=6;cuda_stages=8;cuda_wide=1,cuda_stages=4;cuda_down=1;cuda_down=1,cuda_stages=4;cuda_down=1,cuda_stages=6;cuda_down=1,cuda_stages=8}" \
    "${SF_CONFIGS8:-cuda_stages=0;cuda_stages=4;cuda_stages=6;cuda_stages=8}"
fi

if has exactstep; then
  # The 48B B = 1 step: main (model.EXCESS_PRECISION False, 262 launches compiled for the H200 offline) against XLA's
  # default precision (281), then main again: each its own process (docs/PERF.md, twenty-first session).
  S48="--config kimi-linear-48b --layers all --experts 64 --tp 1 --context 4k --batch 1 --strategies stock --variants serving/auto --steps 20 --repeats 5"
  for run in main excess main2; do
    echo "== 48B B = 1 step: $run ($(date -u +%T))"
    if [ "$run" = excess ]; then cmd="$PY scripts/gpu/step_with_kernel.py jaxk3.model:EXCESS_PRECISION=1 --"
    else cmd="$PY -m jaxk3.cli bench decode"; fi
    # shellcheck disable=SC2086
    timeout -k 5 ${ES_TIMEOUT:-150} $cmd $S48 --json "$OUT/exactstep_$run.json" 2>&1 | grep -E "^ +1 \||rror" | tail -3
  done
fi

if has moeblock; then
  # Kimi-Linear-48B's MoE block at one token as the decode step calls it, in XLA and through the Pallas kernels, each
  # against the float64 block (tests/test_kernels.py::test_moe_block_paths_against_float64_on_gpu), its errors printed.
  echo "== the 48B MoE block's paths against float64 ($(date -u +%T))"
  timeout -k 10 "${MB_TIMEOUT:-180}" $PY -m pytest tests/test_kernels.py -m gpu -k moe_block_paths -q -s -rfEs \
    -p no:cacheprovider > "$OUT/moeblock_tests.log" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  echo "tests rc $rc"; grep -E "^(FAILED|ERROR)|passed|failed|rror|Mismatch|moe block," "$OUT/moeblock_tests.log" | cut -c1-300 | tail -12
fi

if has bf16step; then
  # The 48B B = 1 step: main, then each BS_PATCHES entry (';'-separated step_with_kernel.py patch lists; none by
  # default), main again (BS_AGAIN=0: not; BS_MAIN=0: nor first): one process each (BS_TIMEOUT seconds each).
  # BS_VARIANTS (default serving/auto,serving/off) runs XLA's path in each process too: its logits against the
  # kernels' (the JSON's logits_rel_diff; ~0.007 between main's paths on an H200, 2026-12-01) and each process's
  # greedy tokens; BS_VARIANTS=serving/auto times the kernels' path alone.  BS_LAYERS (default all; e.g. 0-3) the layers:
  # with fewer, less of a path's roundings is amplified on the way to the logits.
  S48="--config kimi-linear-48b --layers ${BS_LAYERS:-all} --experts 64 --tp 1 --context 4k --batch 1 --strategies stock --variants ${BS_VARIANTS:-serving/auto,serving/off} --steps 20 --repeats 5"
  IFS=';' read -ra patches <<< "${BS_PATCHES:-}"
  again=main2; [ "${BS_AGAIN:-1}" = 0 ] && again=
  first=main; [ "${BS_MAIN:-1}" = 0 ] && first=
  i=0  # (each run's JSON numbered by its place, so that a patch list given twice keeps both runs)
  for run in $first "${patches[@]}" $again; do
    i=$((i + 1))
    echo "== 48B B = 1 step: $run ($(date -u +%T))"
    if [ "$run" = main ] || [ "$run" = main2 ]; then cmd="$PY -m jaxk3.cli bench decode"
    else cmd="$PY scripts/gpu/step_with_kernel.py $run --"; fi
    # shellcheck disable=SC2086
    timeout -k 5 ${BS_TIMEOUT:-125} $cmd $S48 --json "$OUT/bf16step_${i}_${run//[^A-Za-z0-9]/_}.json" 2>&1 | grep -E "^ +1 \||rror" | tail -3
  done
  $PY - "$OUT" <<'EOF'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/bf16step_*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.rsplit("/", 1)[-1], r["strategy"], f"{r['us_per_step']:.1f} us, synced {r['us_per_step_synced']:.1f}, "
              f"x{r['ratio_to_floor']:.3f}, logits vs the first variant {r['logits_rel_diff']:.2e}, tokens "
              f"{r['tokens']}, rerun equal {r['rerun_equal']}")
EOF
fi

if has bf16gen; then
  # What a user feels of a patch list: `bench generate` at the 48B's dims (BG_EXPERTS routed experts kept, 64 by
  # default so that it fits an H100; the decode loop reads top-8 either way), B = 1, a 4096-token prompt and 256 new
  # tokens, main (BG_MAIN=0: not) and then each BG_PATCHES entry (default: BS_PATCHES's; none), one process each
  # (BG_TIMEOUT seconds each).  Inside the device's decode loop (a while loop) the step's buffers keep their
  # addresses: the loop may rank a patch otherwise than `bench decode`'s back-to-back steps.
  IFS=';' read -ra patches <<< "${BG_PATCHES:-${BS_PATCHES:-}}"
  G48="generate --config kimi-linear-48b --tp 1 --batch 1 --experts ${BG_EXPERTS:-64} --prompt 4096 --new 256"
  first=main; [ "${BG_MAIN:-1}" = 0 ] && first=
  i=0
  for run in $first "${patches[@]}"; do
    i=$((i + 1))
    echo "== 48B B = 1 generate: $run ($(date -u +%T))"
    # shellcheck disable=SC2086
    timeout -k 5 ${BG_TIMEOUT:-150} $PY scripts/gpu/step_with_kernel.py ${run/#main/} -- $G48 \
      --json "$OUT/bf16gen_${i}_${run//[^A-Za-z0-9]/_}.json" 2>&1 | grep -E "decode .* tok/s|rror" | tail -3
  done
fi

if has timeline; then
  # Where a step's time goes beyond its kernels (twenty-seventh session; first run in the twenty-ninth: the 48B B = 1
  # step's GPU busy 99.8% with command buffers on): `bench decode --census` prints the GPU's timeline over its
  # profiled back-to-back steps (census.device_timeline: the span a step, the union of its device events, the idle
  # gaps between them by length). The 48B B = 1 step and K3 layers 11-14 packed B = 1 (TL_MODELS, default "48 k3"),
  # each with XLA's command buffers as served (on) and off (TL_CB, default "on off"; TL_TIMEOUT seconds a process).
  T48="--config kimi-linear-48b --layers all --experts 64 --tp 1 --context 4k --batch 1 --strategies stock --variants serving/auto"
  TK3="--config k3 --layers 11-14 --experts 32 --tp 1 --context 4k --batch 1 --strategies packed+sharded+one-shot"
  for m in ${TL_MODELS:-48 k3}; do
    args=$T48; [ $m = k3 ] && args=$TK3
    for cb in ${TL_CB:-on off}; do
      echo "== timeline: $m B = 1, command buffers $cb ($(date -u +%T))"
      flags="${XLA_FLAGS:-}"; [ $cb = off ] && flags="$flags --xla_gpu_enable_command_buffer="
      # shellcheck disable=SC2086
      XLA_FLAGS="$flags" timeout -k 5 "${TL_TIMEOUT:-150}" $PY -m jaxk3.cli bench decode $args --steps 10 --census \
        --json "$OUT/timeline_${m}_$cb.json" 2>&1 | grep -E "GPU timeline|^total|rror" | cut -c1-600 | tail -4
    done
  done
fi

if has cudancu; then
  # Nsight Compute on the MXFP4 CUDA kernels as the sweep runs them (K3's TP 2 share, NCU_BATCH tokens; the default
  # config first, then NCU_CONFIG): each launch's template instance is in its name (GateUpKernel<form, l2>).
  echo "== Nsight Compute: the CUDA MXFP4 kernels, B = ${NCU_BATCH:-1}, ${NCU_CONFIG:-cuda_raw=1,cuda_down=1} ($(date -u +%T))"
  NCU=$(ncu_bin)
  timeout -k 5 ${NCU_TIMEOUT:-200} $NCU --clock-control none --target-processes all -k regex:"GateUpKernel|DownKernel" \
    --launch-skip ${NCU_SKIP:-4} --launch-count ${NCU_COUNT:-8} \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
    --metrics "$NCU_STALLS" \
    $PY scripts/gpu/moe_experts_sweep.py --preset k3 --batch ${NCU_BATCH:-1} --formats mxfp4 \
    --configs "${NCU_CONFIG:-cuda_raw=1,cuda_down=1}" > "$OUT/cudancu.txt" 2>&1
  echo "ncu rc $?"
  grep -E "^  [A-Za-z_]+.*\(|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issued Warp|Waves Per SM" \
    "$OUT/cudancu.txt" | head -60
  grep -E "stalled_.*ratio" "$OUT/cudancu.txt" | awk '$NF+0 > 0.3' | head -30
fi

if has groupedncu; then
  # Nsight Compute on the prefill's grouped-GEMM kernels (default config, 48B dims, 4096 tokens x 8 of 256 experts), then
  # on the plain GEMM of the same FLOPs (cuBLAS) in a second pass. XLA's command buffers off: with them on, ncu
  # segfaulted (rc 139) at the first kernel inside a command buffer (thirty-fourth session).
  NCU=$(ncu_bin)
  gncu() {  # $1 kernel regex, $2 launches skipped, $3 launches profiled, $4 file under $OUT
    echo "== Nsight Compute: $1 ($(date -u +%T))"
    XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout -k 5 ${GNCU_TIMEOUT:-150} $NCU --clock-control none \
      --target-processes all -k regex:"$1" --launch-skip $2 --launch-count $3 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats \
      --metrics "$NCU_STALLS" \
      $PY scripts/gpu/moe_grouped.py --json /tmp/jaxk3_ncu_grouped.json --tokens 4096 --no-sweep --no-dense > "$OUT/$4" 2>&1
    echo "ncu rc $?"
    grep -E "^  [A-Za-z_]+.*\(|Duration|DRAM Throughput|L2 Cache Throughput|L2 Hit|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Dynamic Shared|Grid Size" \
      "$OUT/$4" | cut -c1-200 | head -60
  }
  # launches 1-2 are the reference call's; 3-6 the first two timed calls of the default
  gncu "grouped_gate_up|grouped_down" 2 4 ncu_grouped.txt
  gncu "gemm|Gemm|nvjet|cutlass|xmma" 3 1 ncu_gemm.txt
fi

if has bench_off; then
  echo "== bench, command buffers off ($(date -u +%T))"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" bench cb_off
fi
echo "== done ($(date -u +%T)), status $status"
exit $status
