#!/usr/bin/env bash
# One GPU call (2026-12-02, fifth session): moe_experts_routed's compiled tests, the 48B step at B = 1 with and
# without it (64 experts, and all 256, where auto does not yet take it), and with three other tilings of its kernels (finer grids: the
# 576 programs of the default tiling load 132 SMs unevenly), then the 256-expert pair
# (their random weights take minutes to draw: 150 s timeouts were too short on 2026-12-02; run them on their own).
#   OUT=... bash scripts/gpu/routed_call.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
S="--config kimi-linear-48b --layers all --tp 1 --batch 1 --context 4k --strategies stock --variants serving/auto --steps 20 --repeats 5"
f() { grep -E "^ +[0-9]+ \|" | tail -3; }
echo "== tests $(date -u +%T)"; timeout 150 python3 -m pytest tests/test_kernels.py -m gpu -q -p no:cacheprovider -k routed > $OUT/routed_tests.log 2>&1; tail -1 $OUT/routed_tests.log
echo "== 64 experts, auto (routed) $(date -u +%T)"; timeout 120 python3 -m jaxk3.cli bench decode $S --experts 64 --json $OUT/ab64_routed.json 2>&1 | f
echo "== 64 experts, routed left out $(date -u +%T)"; timeout 120 python3 scripts/gpu/step_with_kernel.py -moe_experts_routed -- $S --experts 64 --json $OUT/ab64_without.json 2>&1 | f
for c in "moe_experts:Config.bn=8" "moe_experts:Config.bn=8 moe_experts:Config.splits=4" "moe_experts:Config.bk=128 moe_experts:Config.splits=8"; do
  echo "== 64 experts, routed, $c $(date -u +%T)"; timeout 120 python3 scripts/gpu/step_with_kernel.py $c -- $S --experts 64 --json "$OUT/ab64_$(echo $c | sed 's/moe_experts:Config\.//g' | tr -c 'a-z0-9' '_').json" 2>&1 | f
done
echo "== 256 experts, routed patched in $(date -u +%T)"; timeout 330 python3 scripts/gpu/step_with_kernel.py moe_experts_routed -- $S --experts 256 --json $OUT/ab256_routed.json 2>&1 | f
echo "== 256 experts, auto (without) $(date -u +%T)"; timeout 330 python3 -m jaxk3.cli bench decode $S --experts 256 --json $OUT/ab256_without.json 2>&1 | f
echo "== done $(date -u +%T)"
