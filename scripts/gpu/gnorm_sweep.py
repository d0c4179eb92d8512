"""KDA's o_proj with the gated norm in its prologue (`gemv.gemv_gnorm`) at the 48B's shape (N 2304, K 4096, heads of
128, B = 1) in its tilings, against XLA's path it replaces (the gated norm, then the dot) and XLA's plain dot of the
same weight (what the MLA block's o_proj streams at), in the same run: each a dependent chain of CHAIN calls in one jit,
the median per call.  Prints us, GB/s of the weight, the error against XLA's path, and on its last line
`best: PATCH` (step_with_kernel.py's patch for the fastest tiling, or `best: -` when none beats the default by 2%).

    python scripts/gpu/gnorm_sweep.py [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

from jaxk3.kernels import gemv as G  # noqa: E402

N, K, D = 2304, 4096, 128
CHAIN, INNER, REPS = 20, 5, 7
TILINGS = [(0, 0, 0)] + [(sp, bn, 4) for sp in (2, 4, 8, 16) for bn in (8, 16, 32)] + [(4, 16, 8), (8, 16, 8)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "gnorm_sweep.json"))
    a = ap.parse_args(argv)
    log = timing.logger(a.json)
    dev = jax.devices()[0]
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(k[0], (1, K), jnp.float32)
    z = jax.random.normal(k[1], (1, K), jnp.float32)
    g = 1 + 0.1 * jax.random.normal(k[2], (D,), jnp.float32)
    w = (0.02 * jax.random.normal(k[3], (N, K), jnp.float32)).astype(jnp.bfloat16)
    eps, dt = 1e-6, jnp.bfloat16

    def chained(f):
        def run(x, z, g, w):
            def body(_, x):
                o = f(x, z, g, w)  # [1, N]
                return x + 1e-6 * jnp.concatenate([o, o[:, :K - N]], axis=1)
            return jax.lax.fori_loop(0, CHAIN, body, x)
        return jax.jit(run)

    xla = lambda x, z, g, w: G.gnorm_reference(x, z, g, eps, w, dt)  # noqa: E731
    plain = lambda x, z, g, w: jnp.dot(x.astype(dt), w.T, preferred_element_type=jnp.float32)  # noqa: E731
    want = np.asarray(xla(x, z, g, w))
    rows = []
    log(f"# gemv_gnorm at N {N}, K {K}, heads of {D}, B 1 on {dev.device_kind}, jax {jax.__version__}, chain {CHAIN}")
    for name, f in (("xla norm + dot", xla), ("xla plain dot", plain)):
        us = timing.per_call(chained(f), (x, z, g, w), reps=REPS, inner=INNER, chain=CHAIN) * 1e6
        rows.append({"path": name, "us": us, "GBps": N * K * 2 / us / 1e3})
        log(f"{name:34s} {us:7.2f} us  {N * K * 2 / us / 1e3:6.0f} GB/s")
    base = None
    for sp, bn, wr in TILINGS:
        G.GNORM_SPLITS, G.GNORM_BN, G.GNORM_WARPS = sp, bn, wr
        c = G.gnorm_config(N, K, D)
        name = f"gnorm splits {c.splits} bn {c.bn} warps {c.num_warps}" + (" (default)" if sp == 0 else "")
        why = G.gnorm_fits(x, z, g, eps, w, dt, config=c, only_where_faster=False)
        if why:
            log(f"{name:34s} does not fit: {why}")
            continue
        f = lambda x, z, g, w, c=c: G.gemv_gnorm(x, z, g, eps, w, dt, config=c)  # noqa: E731
        try:
            us = timing.per_call(chained(f), (x, z, g, w), reps=REPS, inner=INNER, chain=CHAIN) * 1e6
            err = float(np.max(np.abs(np.asarray(f(x, z, g, w)) - want)) / np.max(np.abs(want)))
        except Exception as e:  # a tiling Triton refuses: a row saying so
            log(f"{name:34s} failed: {str(e).splitlines()[0][:150]}")
            continue
        base = us if sp == 0 else base
        rows.append({"path": name, "splits": c.splits, "bn": c.bn, "warps": c.num_warps, "us": us, "err": err,
                     "GBps": N * K * 2 / us / 1e3})
        log(f"{name:34s} {us:7.2f} us  {N * K * 2 / us / 1e3:6.0f} GB/s  err {err:.1e}")
    G.GNORM_SPLITS = G.GNORM_BN = G.GNORM_WARPS = 0
    tiled = [r for r in rows if "splits" in r and r["err"] < 1e-2]
    best = min(tiled, key=lambda r: r["us"]) if tiled else None
    patch = "-"
    if best and base and best["us"] < base / 1.02:
        patch = f"gemv:GNORM_SPLITS={best['splits']}+gemv:GNORM_BN={best['bn']}+gemv:GNORM_WARPS={best['warps']}"
    json.dump({"device": dev.device_kind, "jax": jax.__version__, "rows": rows, "best": patch}, open(a.json, "w"),
              indent=1)
    log(f"best: {patch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
