#!/usr/bin/env bash
# Thirty-eighth session, call 1 (issue 22; queued by the thirty-seventh): the 48B's bf16 MoE experts kernel (kernel 1,
# gate|up + the shared experts, 84.9 MB at 3.2 TB/s in the H200's census: 81% of the copy bandwidth) in other tilings
# at B = 1 alone, against main's (bn 16, bk 256, 4 warps, 3 stages) and XLA; then the MXFP4 targets re-measured (K3's
# TP 2 share, B 1 and 8, the streaming form against the register form; last measured in the twenty-seventh session).
# The fastest bf16 tiling, where it beats main's by >= 3% alone, is written to $OUT/best_patch.txt for call 2's step
# A/B (ab_call.sh).  Predicted: at most ~4 us of kernel 1's 26.8 a MoE block (26 blocks), ~100 us of the step.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
python3 -c "import jaxk3._ffi" 2>/dev/null || OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|H100|H200|rror" | head -20
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
echo "== GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) ($(date -u +%T))"
timeout -k 5 ${C1_BF_T:-150} python3 scripts/gpu/moe_experts_sweep.py --preset kl --batch 1 --formats bf16 \
  --configs "${C1_CONFIGS:-bn=32;bn=64;bn=128;bn=32,num_warps=8;bn=64,num_warps=8;bn=16,num_stages=4;bn=32,bk=128;bn=16,bk=512}" \
  --json "$OUT/moe_kl_b1.json" 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
try:
    rows = [r for r in json.load(open(f"{out}/moe_kl_b1.json"))["rows"] if "us" in r and r["path"].startswith("kernel")]
except (OSError, ValueError, KeyError):
    rows = []
main = next((r["us"] for r in rows if r["name"] == "kernel default"), None)
best = min(rows, key=lambda r: r["us"], default=None)
patch = "-"
if main and best and best["us"] < 0.97 * main:
    patch = "+".join(f"moe_experts:Config.{kv.strip()}" for kv in best["name"][len("kernel "):].split(","))
print(f"== main's tiling {main} us, the fastest {best and best['name']} {best and best['us']} us: patch {patch}")
open(f"{out}/best_patch.txt", "w").write(patch + "\n")
PY
for b in 1 8; do
  cf="cuda_stages=0;cuda_stages=4"; [ $b = 8 ] && cf="cuda_stages=0;cuda_stages=8"
  echo "== MXFP4, K3 TP 2 share, B = $b ($(date -u +%T))"
  timeout -k 5 ${C1_MX_T:-120} python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch $b --formats mxfp4 --configs "$cf" \
    --json "$OUT/mxfp4_k3_b$b.json" 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
done
echo "== done ($(date -u +%T))"
} 2>&1 | tee "$OUT/printed.txt"
