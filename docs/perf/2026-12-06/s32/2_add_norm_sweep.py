"""The `add_rms_norm` kernel alone against XLA's path (its two kernels) at the 48B's hidden size, one row: a chain of
CHAIN dependent calls in one jit (an optimization barrier between links, so that XLA fuses each link as the step
does), per call in us, for the kernel's tilings (num_warps, bk).  Prints the best and whether it beat XLA.

    python3 scripts/gpu/add_norm_sweep.py [--S 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxk3.kernels import add_norm  # noqa: E402
from jaxk3.model import compiler_options  # noqa: E402
from timing import per_call  # noqa: E402

CHAIN = int(os.environ.get("CHAIN", 20))


def chain(fn):
    def run(x, parts, w):
        for i in range(CHAIN):
            x = jax.lax.optimization_barrier(fn(x, parts[i], w))
        return x
    return jax.jit(run, compiler_options=compiler_options())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=4)
    ap.add_argument("--D", type=int, default=2304)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, a.D)), jnp.bfloat16)
    parts = jnp.asarray(rng.standard_normal((CHAIN, a.S, 1, a.D)), jnp.float32)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(a.D), jnp.bfloat16)
    res = {}
    xla = chain(lambda x, p, w: add_norm.reference(x, p, w, 1e-5))
    res["xla"] = per_call(xla, (x, parts, w), reps=15, inner=20, chain=CHAIN) * 1e6
    ref = np.asarray(xla(x, parts, w), np.float32)
    print(f"add_rms_norm, D {a.D}, S {a.S}, B 1: XLA {res['xla']:.2f} us a call", flush=True)
    for nw in (1, 2, 4, 8):
        for bk in (64, 128, 256):
            if a.D % bk:
                continue
            add_norm.BK = bk
            k = chain(lambda x, p, w, nw=nw: add_norm.add_rms_norm(x, p, w, 1e-5, num_warps=nw))
            got = np.asarray(k(x, parts, w), np.float32)
            us = per_call(k, (x, parts, w), reps=15, inner=20, chain=CHAIN) * 1e6
            same = float(np.mean(got == ref))
            res[f"nw{nw}_bk{bk}"] = us
            print(f"  kernel num_warps {nw} bk {bk}: {us:.2f} us ({res['xla'] / us:.2f}x XLA), chain output "
                  f"{same:.4f} bitwise XLA's", flush=True)
    add_norm.BK = None
    # the floor of a launch: one elementwise op on the row, an XLA fusion against a one-program Pallas kernel
    from jax.experimental import pallas as pl
    from jaxk3.kernels.registry import triton_params

    def tiny_kernel(x_ref, o_ref):
        for i in range(a.D // 256):
            cols = pl.ds(i * 256, 256)
            o_ref[0, cols] = (x_ref[0, cols].astype(jnp.float32) * 1.0001 + 1.0).astype(o_ref.dtype)

    def tiny_pallas(x, p, w):
        any_ = pl.BlockSpec(memory_space=pl.ANY)
        return pl.pallas_call(tiny_kernel, grid=(1,), in_specs=[any_], out_specs=any_,
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name="tiny",
                              **triton_params(4, 1, False))(x)
    for name, fn in (("tiny_xla", lambda x, p, w: (x.astype(jnp.float32) * 1.0001 + 1.0).astype(x.dtype)),
                     ("tiny_pallas", tiny_pallas)):
        res[name] = per_call(chain(fn), (x, parts, w), reps=15, inner=20, chain=CHAIN) * 1e6
        print(f"  {name}: one elementwise op on the row, {res[name]:.2f} us a call", flush=True)
    best = min((k for k in res if k.startswith("nw")), key=res.get)
    print(f"best {best} {res[best]:.2f} us against XLA {res['xla']:.2f}: {'faster' if res[best] < res['xla'] else 'slower'}")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
