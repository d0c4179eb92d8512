#!/usr/bin/env bash
# One GPU call for a decode kernel's A/B in the step (issue 22; first written for the norm prologues): its compiled
# tests ($TEST_FILES, pytest -k "$TEST_K"; default gemv_norm and router_topk's normed form at real dims;
# SKIP_TESTS=1: none), then the Kimi-Linear-48B step (27 layers, 64 experts, TP 1, 4K) with the kernels
# in $PATCH patched in (scripts/gpu/step_with_kernel.py; variants $PATCHED_VARIANTS) against the same bench without
# them (serving/auto: main before), then the patched step's census (layers $CENSUS_LAYERS, command buffers off,
# B = 1, with its HLO; SKIP_CENSUS=1: none).
#   OUT=... STEP_BATCH=1,8 PATCH=gemv_norm bash scripts/gpu/prologue_call.sh
#   PATCH=moe_experts_routed TEST_FILES=tests/test_kernels.py TEST_K=routed bash scripts/gpu/prologue_call.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
PY=${PY:-python3}
B=${STEP_BATCH:-1}
PATCH=${PATCH:-gemv_norm router_topk}
STEP="--config kimi-linear-48b --layers all --experts 64 --tp 1 --batch $B --context 4k --strategies stock --steps 20 --repeats 5"
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== compiled tests ($(date -u +%T))"
  timeout -k 10 ${T_TIMEOUT:-180} $PY -m pytest ${TEST_FILES:-tests/test_gemv.py tests/test_kernels.py} -m gpu -q -rfEs \
    -p no:cacheprovider -k "${TEST_K:-norm_prologue_on_gpu or router_topk}" > "$OUT/prologue_tests.log" 2>&1
  echo "tests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/prologue_tests.log" | cut -c1-300 | tail -12
fi
echo "== 48B step, patched: $PATCH ($(date -u +%T))"
timeout -k 10 ${S_TIMEOUT:-200} $PY scripts/gpu/step_with_kernel.py $PATCH -- $STEP \
  --variants ${PATCHED_VARIANTS:-serving/auto} --json "$OUT/step_patched.json" 2>&1 | grep -v "^  \.\. " | grep -v "^note" | tail -7
echo "== 48B step, serving/auto, as main before ($(date -u +%T))"
timeout -k 10 ${S_TIMEOUT:-200} $PY -m jaxk3.cli bench decode $STEP --variants serving/auto --json "$OUT/step_base.json" 2>&1 \
  | grep -v "^  \.\. " | grep -E "^ +[0-9]+ \|" | tail -4
[ -n "${SKIP_CENSUS:-}" ] && { echo "== done, no census ($(date -u +%T))"; exit 0; }
echo "== census of the patched step, layers ${CENSUS_LAYERS:-0-3} ($(date -u +%T))"
rm -rf /tmp/jaxk3_phlo  # a reused machine's earlier HLO must not ship with this run's
XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout -k 10 ${C_TIMEOUT:-150} $PY scripts/gpu/step_with_kernel.py $PATCH -- \
  --config kimi-linear-48b --layers ${CENSUS_LAYERS:-0-3} --experts 64 --tp 1 --batch 1 --context 4k --strategies stock \
  --variants serving/auto --steps 10 --census --json "$OUT/census_patched.json" --hlo-dir /tmp/jaxk3_phlo 2>&1 \
  | grep -E "^(total|kernels per)" | head -4
tar -C /tmp -czf "$OUT/census_patched_hlo.tgz" jaxk3_phlo 2>/dev/null || true
echo "== done ($(date -u +%T))"
