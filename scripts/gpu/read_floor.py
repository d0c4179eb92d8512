"""What one kernel that only reads can stream at the decode step's sizes: XLA's row sums of bf16 [N, 2304] matrices
(10.6 MB, an o_proj; 42.5 MB, a MoE block's down projections; 84.9 MB, its gate|up; 170 MB; 755 MB, the lm head),
each in a dependent chain of 20 distinct matrices in one jit (so no call reads from L2 what the last one left), the
median per call.  Beside them the copy bandwidth `jaxk3 bench decode` uses for its floor.  A kernel of the step at
these sizes cannot beat the row sum's rate by much: the ratio of the step's kernels to this rate is what a better
tiling could still win, the rest is a kernel's fixed cost (launch, ramp, tail).

    python scripts/gpu/read_floor.py --json out/read_floor.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

from jaxk3.tools import bench_decode as bd  # noqa: E402

K = 2304
CHAIN = 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="out/read_floor.json")
    ap.add_argument("--mb", default="10.6,42.5,84.9,170,755")
    a = ap.parse_args(argv)
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    log = timing.logger(a.json)
    dev = jax.devices()[0]
    copy = bd.copy_bandwidth(jax.make_mesh((1,), (bd.TP,))) / 1e9
    log(f"jax {jax.__version__} on {dev.device_kind}; copy bandwidth {copy:.0f} GB/s (bench decode's floor)")
    rows = []
    for mb in (float(m) for m in a.mb.split(",")):
        N = int(mb * 1e6 / (2 * K)) // 16 * 16
        ws = [jax.random.normal(jax.random.key(i), (N, K), jnp.float32).astype(jnp.bfloat16) for i in range(CHAIN)]

        def chain(ws):
            y = jnp.zeros((N,), jnp.float32)
            for w in ws:  # each sum waits on the last (a scalar of it): one kernel per matrix, in order
                y = jnp.sum(w.astype(jnp.float32) * (1 + 0 * y[0]), axis=1)
            return y
        c = jax.jit(chain)
        s = timing.per_call(c, (ws,), reps=5, inner=3, chain=CHAIN)
        nbytes = N * K * 2
        rows.append(dict(mb=nbytes / 1e6, N=N, us=s * 1e6, gbps=nbytes / s / 1e9))
        log(f"row sums [{N}, {K}] bf16 {nbytes / 1e6:7.1f} MB  {s * 1e6:8.2f} us  {nbytes / s / 1e9:6.0f} GB/s"
            f"  ({nbytes / s / 1e9 / copy:.2f} of the copy; at the copy {nbytes / copy / 1e3:7.2f} us)")
        del ws
    with open(a.json, "w") as fh:
        json.dump(dict(jax=jax.__version__, device=dev.device_kind, copy=copy, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
