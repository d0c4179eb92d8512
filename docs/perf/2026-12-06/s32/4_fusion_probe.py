"""The thirty-first session's divergence under XLA's Triton fusions, narrowed: on the same random weights and cache (every
step's token inside the cache), N greedy steps with the stock compile, the stock compile again (a fresh build), and with
`jaxk3.model.TRITON_FUSIONS` (4_triton_fusions.patch applied); each run's logits against the first run's, per step; and
a checksum of every weight before and after the runs (a step must not write its weights)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())
from jaxk3 import model  # noqa: E402
from jaxk3.tools import bench_decode as bd  # noqa: E402


def checksum(tree) -> float:
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")]
    return float(sum(float(jnp.sum(jnp.abs(x.astype(jnp.float32)))) for x in leaves))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--back", type=int, default=None, help="the cache's length: context - 1 - back (default steps)")
    a = ap.parse_args()
    back = a.steps if a.back is None else a.back
    s = bd.with_variants((bd.Strategy("stock", False, "lax"),), [("serving", "auto")])[0]
    full, first, last, cfg, mesh, _ = bd._setup("kimi-linear-48b", "all", 64, 1, [1], (s,))
    made = bd._Weights(cfg, mesh, jax.numpy.bfloat16)
    runs, sums = {}, []
    for name, on in (("stock", False), ("stock again", False), ("triton fusions", True)):
        model.TRITON_FUSIONS = on
        _, _, weights, step, cache, ids, valid = bd._case(cfg, made, mesh, jax.numpy.bfloat16, first, 1, a.context, s,
                                                         lambda g: None)
        sums.append(checksum(weights))
        cache = dataclasses.replace(cache, length=bd.put_batch(np.full((1,), a.context - 1 - back, np.int32), mesh))
        out = []
        for _ in range(a.steps):
            logits, ids, cache = step(weights, cache, ids, valid)
            out.append((np.asarray(logits, np.float32), int(np.asarray(ids)[0])))
        runs[name] = out
        sums.append(checksum(weights))
    print("weights' checksums before/after each run:", sums, "all equal" if len(set(sums)) == 1 else "DIFFER")
    base = runs["stock"]
    for name in ("stock again", "triton fusions"):
        for t, ((l0, i0), (l1, i1)) in enumerate(zip(base, runs[name])):
            rel = float(np.abs(l1 - l0).max() / np.abs(l0).max())
            print(f"{name} step {t}: max|dlogits|/max|logits| {rel:.2e}, bitwise {bool(np.array_equal(l0, l1))}, "
                  f"tokens {i0} {i1}")


if __name__ == "__main__":
    main()
