# thirty-third session, 2026-12-06, 1x H100 80GB HBM3 (both calls, one warm machine; the first try named no kind),
# jax/jaxlib 0.11.2, Python 3.12 (the device image). Files start with their call's number; N_printed.txt is call N's
# printed output. Both calls ran the tree at 4fbd9e1 (block_pairs and down_bn present, off by default) with the
# untracked scripts/gpu/s33_call1.sh below. Eight earlier tries between 12:45 and 14:10 got no machine ("no device
# machine could be started right now") and cost 1381 s of the session's 1800 s of device time.
# The removed form is 1_block_pairs.patch: `git diff 7cb5812 4fbd9e1` over the files it touched (it also holds the
# thirty-second session's kernel names, which stayed); commit 4fbd9e1 has it whole.
#
# ---- call 1 (wall 78.0 s): C1_K=pairs_on_gpu C1_TESTS=60 C1_BENCH=165 bash scripts/gpu/s33_call1.sh
#!/usr/bin/env bash
# Thirty-third session, call 1: build; the grouped GEMM's block pairs (and kernel 2's wide tiles, down_bn) compiled
# (tests) and timed against the Triton default before and after at the 48B's dims (issue 23).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="$OUT/printed.txt"
{
OUT=/tmp/gc bash scripts/gpu_check.sh env build 2>&1 | grep -E "^==|GPU|H100|H200|rror" | head -20
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.92
echo "== grouped: compiled tests ($(date -u +%T))"
timeout -k 5 ${C1_TESTS:-120} python3 -m pytest tests/test_kernels.py -m gpu -k "${C1_K:-grouped and (pairs or kernel_on_gpu)}" -q -rfEs \
  -p no:cacheprovider > "$OUT/grouped_tests.log" 2>&1
echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/grouped_tests.log" | cut -c1-300 | tail -12
echo "== grouped: pairs against the default ($(date -u +%T))"
timeout -k 5 ${C1_BENCH:-230} python3 scripts/gpu/moe_grouped.py --json "$OUT/moe_grouped.json" --tokens 4096 --pairs --no-dense 2>&1 | cut -c1-220
echo "== done ($(date -u +%T))"
} 2>&1 | tee "$P"
#
# ---- call 2 (wall 180.6 s, on call 1's warm machine): Model.score beside the B = 1 prefill; it ran out of memory:
# scripts/gpu/prefill_chunks.py keeps all 256 experts (91.5 GB of weights) and an H100 has 80 GB (2_printed_head.txt)
OUT_=$OUT; export JAX_PLATFORMS=cuda; OUT=/tmp/gc CH_TIMEOUT=180 CH_ARGS="--batches 1 --chunks 1:4096" bash scripts/gpu_check.sh chunks 2>&1 | tee $OUT_/printed2.txt; cp /tmp/gc/prefill_chunks.json $OUT_/ 2>/dev/null
