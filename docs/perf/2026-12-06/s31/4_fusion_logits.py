"""The decode step compiled with and without `jaxk3.model.TRITON_FUSIONS` (XLA's Triton emitter for its own fusions)
in one process, on the same random weights and caches: N greedy steps each, the logits' largest difference relative to
max|logits| per step, and whether the greedy tokens agree.  On a CPU it runs (the option is the GPU's: bitwise there).

    python scripts/gpu/fusion_logits.py [--config kimi-linear-48b] [--layers all] [--experts 64] [--steps 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.getcwd())
from jaxk3 import model  # noqa: E402
from jaxk3.tools import bench_decode as bd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="kimi-linear-48b")
    ap.add_argument("--layers", default="all")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    s = bd.with_variants((bd.Strategy("stock", False, "lax"),), [("serving", "auto")])[0]
    full, first, last, cfg, mesh, _ = bd._setup(a.config, a.layers, a.experts, 1, [1], (s,))
    made = bd._Weights(cfg, mesh, jax.numpy.bfloat16)
    runs = {}
    for on in (False, True):
        model.TRITON_FUSIONS = on
        _, _, weights, step, cache, ids, valid = bd._case(cfg, made, mesh, jax.numpy.bfloat16, first, 1, a.context, s,
                                                         lambda g: None)
        # every step's token inside the cache: the random cache holds context - 1 tokens of its context slots
        cache = dataclasses.replace(cache, length=bd.put_batch(np.full((1,), a.context - 1 - a.steps, np.int32), mesh))
        out = []
        for _ in range(a.steps):
            logits, ids, cache = step(weights, cache, ids, valid)
            out.append((np.asarray(logits, np.float32), int(np.asarray(ids)[0])))
        runs[on] = out
    same = 0
    for t, ((l0, i0), (l1, i1)) in enumerate(zip(runs[False], runs[True])):
        rel = float(np.abs(l1 - l0).max() / np.abs(l0).max())
        same += i0 == i1
        print(f"step {t}: max|dlogits|/max|logits| {rel:.2e}, tokens {i0} {i1}{'' if i0 == i1 else '  DIFFER'}")
    print(f"greedy tokens equal {same}/{a.steps}")


if __name__ == "__main__":
    main()
