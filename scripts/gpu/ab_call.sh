#!/usr/bin/env bash
# One GPU call for several kernels' step A/Bs (issue 22): their compiled tests ($TEST_FILES, pytest -k "$TEST_K"),
# then the Kimi-Linear-48B step (27 layers, $EXPERTS experts, TP 1, 4K, serving/auto) once per batch size as main
# has it (LAYERS: a slice instead of all 27) and once per PATCH@B entry of $AB with the patch applied (scripts/gpu/step_with_kernel.py's arguments joined
# by '+': NAME taken by auto wherever it fits, -NAME left out, MODULE:CLASS.FIELD=VALUE a config default), each in
# its own process.  One start for what several prologue_call.sh calls would measure.  AGAIN=1: main once more at the
# end, so that a drift of the GPU's speed between the processes is seen (each row's floor uses its own process's
# measured copy bandwidth: compare the ratios to the floor too).
#   AB="gemv_gnorm@1 mla_decode_uv@1" TEST_K="gnorm or mla_decode_uv" bash scripts/gpu/ab_call.sh
#   AB="-moe_experts_routed@1 moe_experts:Config.bn=8+moe_experts:Config.splits=4@1" bash scripts/gpu/ab_call.sh
#   EXPERTS=256 S_TIMEOUT=330 AB="moe_experts_routed@1" bash scripts/gpu/ab_call.sh   # random weights take minutes
#   EXPERTS=256 LAYERS=0-7 AB="moe_experts_routed@1" bash scripts/gpu/ab_call.sh     # the first 8 layers only
#   CONTEXT=32k AB="mla_decode:ORDER=pg@1" bash scripts/gpu/ab_call.sh                # another cache length (4k default)
# CENSUS=PATCH (step_with_kernel.py's arguments joined by '+'): at the end, the kernel census of layers 0-3 at B = 1
# with that patch (command buffers off, so that every kernel has its own time; the compiled HLO kept beside it).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
S="--config kimi-linear-48b --layers ${LAYERS:-all} --experts ${EXPERTS:-64} --tp 1 --context ${CONTEXT:-4k} --strategies stock --variants serving/auto --steps 20 --repeats 5"
row() { grep -E "^ +[0-9]+ \|" | tail -3; }
if [ -n "${TEST_K:-}" ]; then
  echo "== compiled tests ($(date -u +%T))"
  timeout -k 10 ${T_TIMEOUT:-200} python3 -m pytest ${TEST_FILES:-tests/test_gemv.py tests/test_kernels.py} -m gpu -q -rfEs \
    -p no:cacheprovider -k "$TEST_K" > "$OUT/ab_tests.log" 2>&1
  echo "tests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/ab_tests.log" | cut -c1-300 | tail -12
fi
for B in $(for p in ${AB:?AB=PATCH@B ...}; do echo "${p##*@}"; done | sort -u); do
  echo "== B = $B, main ($(date -u +%T))"
  timeout -k 10 ${S_TIMEOUT:-150} python3 -m jaxk3.cli bench decode $S --batch "$B" --json "$OUT/ab_base_b$B.json" 2>&1 | row
done
for p in $AB; do
  patch=${p%@*}; B=${p##*@}
  tag=$(echo "$patch" | sed 's/moe_experts:Config\.//g; s/mla_decode://g' | tr -c 'a-zA-Z0-9_=\n' '_' | tr '=' '_')
  echo "== B = $B, $patch ($(date -u +%T))"
  timeout -k 10 ${S_TIMEOUT:-150} python3 scripts/gpu/step_with_kernel.py ${patch//+/ } -- $S --batch "$B" \
    --json "$OUT/ab_${tag}_b$B.json" 2>&1 | row
done
if [ -n "${AGAIN:-}" ]; then  # main once more at the end: the GPU's drift between processes shows (A B ... A)
  for B in $(for p in $AB; do echo "${p##*@}"; done | sort -u); do
    echo "== B = $B, main again ($(date -u +%T))"
    timeout -k 10 ${S_TIMEOUT:-150} python3 -m jaxk3.cli bench decode $S --batch "$B" --json "$OUT/ab_again_b$B.json" 2>&1 | row
  done
fi
if [ -n "${CENSUS:-}" ]; then
  echo "== census, layers 0-3, B = 1, $CENSUS ($(date -u +%T))"
  rm -rf /tmp/jaxk3_ab_hlo
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout -k 10 ${C_TIMEOUT:-120} python3 scripts/gpu/step_with_kernel.py \
    ${CENSUS//+/ } -- --config kimi-linear-48b --layers 0-3 --experts ${EXPERTS:-64} --tp 1 --batch 1 \
    --context ${CONTEXT:-4k} --strategies stock --variants serving/auto --steps 10 --census --json "$OUT/ab_census.json" \
    --hlo-dir /tmp/jaxk3_ab_hlo > "$OUT/ab_census.log" 2>&1
  echo "census rc $?"; grep -E "^(layer|head|total|kernels per step)" "$OUT/ab_census.log" | cut -c1-200
  tar -C /tmp -czf "$OUT/ab_census_hlo.tgz" jaxk3_ab_hlo 2>/dev/null || true
fi
# The device tool brings back at most 8 files from $OUT: past that, everything this call wrote goes into one archive.
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  tar -C "$OUT" -czf /tmp/ab_call_all.tgz . && find "$OUT" -mindepth 1 -delete && mv /tmp/ab_call_all.tgz "$OUT/ab_all.tgz" \
    && echo "more than 8 files: packed into $OUT/ab_all.tgz"
fi
echo "== done ($(date -u +%T))"
