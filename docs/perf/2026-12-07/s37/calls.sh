#!/usr/bin/env bash
# Thirty-seventh session's device calls, as run (each in the device tool's copy of the working tree at that commit).
# Call 1 (fresh 1x H100, 233 s): gemv_gnorm's tilings alone, then the 48B B = 1 step: main / the fastest tiling /
# the kernel left out / main again (s36_call3.sh beside this file, as run from scripts/gpu/ at 239b9b4; retired there after the
# call; the compiled tests left out: they passed
# on the H200 in the thirty-sixth session's call 4).  Outputs: 1_printed.txt, 1_gnorm_sweep.json, 1_ab_*.json.
C3_TEST_K= C3_S_T=130 C3_SW_T=90 bash scripts/gpu/s36_call3.sh   # now docs/perf/2026-12-07/s37/s36_call3.sh
