# The sixteenth session's device calls as run (docs/PERF.md, sixteenth-session section): C=N bash scripts/gpu/s16_call.sh,
# a temporary script whose blocks are copied here.  Raw files start with the call's number (ab_call.sh's files prefixed).
# The code each call ran: call 1, main at acadec2 plus the "asm" decode (off) and scripts/gpu/mgpu_probe.py; call 2, "asm"
# the default (2_sweep timed out before printing); calls 3-4, the same; call 5, dense B > 1 bn 64 where In <= 2304.
# Calls 6-8: C=N bash scripts/gpu/s16_call.sh after the asm default: 6 the Mosaic GPU grouped GEMM (plain pipeline), 7 with
# its warp-specialised gate|up, 8 the 48B bf16 B = 1 tiles (the A/B ran only for a tile 5% faster: none was).
#!/usr/bin/env bash
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
O=$OUT; C=${C:-1}
t() { echo "== $* ($(date -u +%T))"; }
K3="--config k3 --layers 11-14 --experts 32 --tp 1 --context 4k --steps 20 --repeats 5 --strategies packed+sharded+one-shot"
if [ "$C" = 1 ]; then
  t tests
  timeout -k 5 110 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "asm_decode_on_gpu or (moe_experts_kernel_on_gpu and mxfp4 and (config6 or config7))" > $O/1_asm_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/1_asm_tests.log | cut -c1-300 | tail -8
  t sweep
  timeout -k 5 150 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 1,8 --formats mxfp4 --configs "decode=asm" --json $O/1_sweep.json 2>&1 | cut -c1-230
  t k3 b1 main; timeout -k 5 90 python3 -m jaxk3.cli bench decode $K3 --batch 1 --json $O/1_k3b1_main.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t k3 b1 asm; timeout -k 5 90 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.decode=asm -- $K3 --batch 1 --json $O/1_k3b1_asm.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t k3 b8 asm; timeout -k 5 90 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.decode=asm -- $K3 --batch 8 --json $O/1_k3b8_asm.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t mgpu; timeout -k 5 150 python3 scripts/gpu/mgpu_probe.py --json $O/1_mgpu.json 2>&1 | grep -v "^  File\|^    " | cut -c1-250 | tail -30
fi
if [ "$C" = 2 ]; then
  t tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider "$T[moe_experts_mxfp4-k3-1-1]" "$T[moe_experts_mxfp4-k3-2-1]" "$T[moe_experts_mxfp4-k3-8-1]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-1]" "$T[moe_experts_mxfp4-k3-1-8]" "$T[moe_experts_mxfp4-k3-2-8]" "$T[moe_experts_mxfp4-k3-8-8]" "$T[moe_experts_mxfp4-kimi-linear-48b-1-8]" > $O/2_real_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/2_real_tests.log | cut -c1-300 | tail -8
  t sweep
  timeout -k 5 170 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 1,8 --formats mxfp4 --configs "decode=f16;bn=32;bk=512;bn=32,bk=512;num_warps=8;num_warps=2;bn=8,bk=512;num_stages=4" --json $O/2_sweep.json 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
  t k3 b1 main; timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch 1 --json $O/2_k3b1_main.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t k3 b1 without; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py -moe_experts -- $K3 --batch 1 --json $O/2_k3b1_without.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t k3 b8 main; timeout -k 5 80 python3 -m jaxk3.cli bench decode $K3 --batch 8 --json $O/2_k3b8_main.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t k3 b8 without; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py -moe_experts -- $K3 --batch 8 --json $O/2_k3b8_without.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
  t kl b8 bf16 tiles
  timeout -k 5 100 python3 scripts/gpu/moe_experts_sweep.py --preset kl --batch 8 --formats bf16 --configs "bn=64;bk=256;bn=64,bk=256" --json $O/2_kl_sweep.json 2>&1 | cut -c1-200
fi
if [ "$C" = 3 ]; then
  t sweep b1
  timeout -k 5 120 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 1 --formats mxfp4 --configs "decode=f16;bn=32;bk=512;num_warps=8;num_warps=2" --json $O/3_sweep.json 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
  t 48b b8 ab
  OUT=$O S_TIMEOUT=150 AB="moe_experts:Config.bn=64@8" bash scripts/gpu/ab_call.sh 2>&1 | tail -8
fi
if [ "$C" = 4 ]; then
  t sweep b1
  timeout -k 5 100 python3 scripts/gpu/moe_experts_sweep.py --preset k3 --batch 1 --formats mxfp4 --configs "bn=32,bk=512;bk=1024;bn=32,num_warps=2;bk=512,num_warps=2;bn=64" --json $O/4_sweep.json 2>&1 | grep -v "does not fit\|needs bn" | cut -c1-200
  t k3 b1 bk512; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.bk=512 -- $K3 --batch 1 --json $O/4_k3b1_bk512.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
  t k3 b1 bn32 bk512; timeout -k 5 80 python3 scripts/gpu/step_with_kernel.py moe_experts:Config.bk=512 moe_experts:Config.bn=32 -- $K3 --batch 1 --json $O/4_k3b1_bn32bk512.json 2>&1 | grep -E "^ +1 \||rror" | tail -3
fi
if [ "$C" = 5 ]; then
  t tests
  T=tests/test_kernels_real.py::test_kernel_real_dims_on_gpu
  timeout -k 5 90 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider "$T[moe_experts-kimi-linear-48b-1-8]" "$T[moe_experts-k3-1-8]" > $O/5_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/5_tests.log | cut -c1-300 | tail -8
  timeout -k 5 60 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_kernels.py -k "moe_experts_kernel_on_gpu and dense and None" > $O/5_tiny.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/5_tiny.log | cut -c1-300 | tail -8
  t 48b b8 main
  S="--config kimi-linear-48b --layers all --experts 64 --tp 1 --context 4k --strategies stock --variants serving/auto --steps 20 --repeats 5"
  timeout -k 5 150 python3 -m jaxk3.cli bench decode $S --batch 8 --json $O/5_48b_b8_main.json 2>&1 | grep -E "^ +8 \||rror" | tail -3
fi

# ---- calls 6-8
if [ "$C" = 6 ]; then
  t tests
  timeout -k 5 120 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "mosaic_on_gpu" > $O/6_mosaic_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/6_mosaic_tests.log | cut -c1-400 | tail -12
  t grouped
  timeout -k 5 300 python3 scripts/gpu/moe_grouped.py --tokens 4096 --mosaic --no-dense --json $O/6_grouped.json 2>&1 | grep -v "Warn\|warn\|^  " | cut -c1-260 | tail -20
fi
if [ "$C" = 7 ]; then
  t tests
  timeout -k 5 120 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "mosaic_on_gpu" > $O/7_mosaic_tests.log 2>&1
  echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|rror" $O/7_mosaic_tests.log | cut -c1-400 | tail -12
  t grouped
  timeout -k 5 300 python3 scripts/gpu/moe_grouped.py --tokens 4096 --mosaic --no-dense --json $O/7_grouped.json 2>&1 | grep -v "Warn\|warn\|^  " | sed 's/Config(//; s/num_warps=4, //; s/, order=.m., gather=True//' | cut -c1-230 | tail -20
fi
if [ "$C" = 8 ]; then
  t kl b1 bf16 tiles
  timeout -k 5 70 python3 scripts/gpu/moe_experts_sweep.py --preset kl --batch 1 --formats bf16 --configs "bn=32;bk=512;num_warps=2;bn=32,num_warps=2" --json $O/8_kl_sweep.json 2>&1 | grep -v "^ \|Warn" | cut -c1-200
  P=$(python3 - "$O/8_kl_sweep.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
k = {r["name"]: r["us"] for r in rows if "us" in r and r["name"].startswith("kernel")}
d = k["kernel default"]
best = min(k, key=k.get)
if k[best] < 0.95 * d and best != "kernel default":
    print("+".join("moe_experts:Config." + f.strip() for f in best.split(" ", 1)[1].split(",")))
PY
)
  echo "best patch: ${P:-none}"
  if [ -n "$P" ]; then t 48b b1 ab; OUT=$O S_TIMEOUT=110 AB="$P@1" bash scripts/gpu/ab_call.sh 2>&1 | tail -6; fi
fi

# ---- call 9 (main at 49ae938: the Mosaic kernels' persistent loop as one helper), ENV as above
timeout -k 5 150 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider -k "mosaic_on_gpu or asm_decode_on_gpu"   # 9_tests.log: 5 passed

# ---- call 10 (main at 0c74257: the raw-decode helper shared by the element-wise and tensor-core tiles), ENV as above
timeout -k 5 150 python3 -m pytest tests/test_kernels.py -m gpu -q -rfEs -p no:cacheprovider \
  -k "mosaic_on_gpu or asm_decode_on_gpu or (moe_experts_kernel_on_gpu and mxfp4 and (None or config1 or config3))"   # 10_tests.log: 23 passed
