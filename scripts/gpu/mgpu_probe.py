"""Can Pallas Mosaic GPU (TMA loads, wgmma, warp-specialised pipelines) carry the prefill's grouped GEMM on this
image?  A probe for issue 23, not a kernel of the project: it times the Hopper kernels jax itself ships
(jax.experimental.pallas.ops.gpu: `hopper_matmul_mgpu.matmul`, `ragged_dot_mgpu.ragged_dot`) at the Kimi-Linear-48B
MoE's prefill shapes against XLA's dot and `lax.ragged_dot`, in one process, and says what fails.

  gate-up of one expert's block  [M, 2304] x [2304, 2048]   (dense, M = 4096)
  the grouped gate-up            [32768, 2304] x 256 x [2304, 2048], rows sorted by expert (4096 tokens x top-8)

    python scripts/gpu/mgpu_probe.py [--json out/mgpu_probe.json] [--groups 256]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402


def _time(f, args, flops: float, log, name: str) -> dict:
    c = jax.jit(f)
    t0 = time.perf_counter()
    try:
        out = jax.block_until_ready(c(*args))
    except Exception as e:  # noqa: BLE001 - the probe reports what fails
        log(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        traceback.print_exc(limit=3)
        return {"name": name, "error": f"{type(e).__name__}: {e}"[:2000]}
    compile_s = time.perf_counter() - t0
    us = timing.per_call(c, args, reps=5, inner=10, chain=1) * 1e6
    log(f"{name}: {us:9.1f} us  {flops / us / 1e6:7.1f} TFLOP/s  (first call {compile_s:.1f} s)")
    return {"name": name, "us": us, "tflops": flops / us / 1e6, "first_call_s": compile_s, "out": out}


def _against(r: dict, ref: dict, name: str, log) -> dict:
    """r with its largest absolute difference from ref's output (both ran), logged."""
    if "out" in r and "out" in ref:
        r[f"max_abs_diff_vs_{name}"] = err = float(jnp.max(jnp.abs(r["out"].astype(jnp.float32)
                                                                   - ref["out"].astype(jnp.float32))))
        log(f"  max |mosaic - {name}| = {err:.3g}")
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="out/mgpu_probe.json")
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args(argv)
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    log = timing.logger(a.json)
    log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    rows = []
    K, N, M = 2304, 2048, 4096
    ka, kb = jax.random.split(jax.random.key(0))
    x = jax.random.normal(ka, (M, K), jnp.bfloat16)
    w = (jax.random.normal(kb, (K, N), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
    flops = 2.0 * M * K * N
    ref = _time(lambda x, w: x @ w, (x, w), flops, log, f"xla dot [{M},{K}]x[{K},{N}]")
    rows.append(ref)
    try:
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

        for tm, tn, steps in ((128, 128, 4), (128, 256, 4), (256, 128, 4)):
            cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=steps)
            rows.append(_against(_time(lambda x, w, cfg=cfg: hm.matmul(x, w, None, cfg), (x, w), flops, log,
                                       f"mosaic hopper matmul tile {tm}x{tn}x64, {steps} stages"), ref, "xla", log))
    except Exception as e:  # noqa: BLE001
        log(f"hopper_matmul_mgpu unavailable: {type(e).__name__}: {e}")

    G, T = a.groups, a.tokens * 8
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(G, 8, replace=False) for _ in range(a.tokens)]).reshape(-1)
    sizes = jnp.asarray(np.bincount(ids, minlength=G).astype(np.int32))
    kx, kw = jax.random.split(jax.random.key(1))
    xs = jax.random.normal(kx, (T, K), jnp.bfloat16)
    ws = (jax.random.normal(kw, (G, K, N), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
    gflops = 2.0 * T * K * N
    log(f"grouped: {T} rows in {G} groups (sizes {int(sizes.min())}-{int(sizes.max())}), weights "
        f"{G * K * N * 2 / 1e9:.2f} GB")
    ref = _time(lambda x, w, s: jax.lax.ragged_dot(x, w, s), (xs, ws, sizes), gflops, log, "lax.ragged_dot")
    rows.append(ref)
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd

        for bm, bn, steps, gbn in ((128, 128, 4, 4), (64, 128, 4, 4), (128, 256, 3, 2)):
            r = _time(lambda x, w, s, bm=bm, bn=bn, steps=steps, gbn=gbn: rd.ragged_dot(
                x, w, group_sizes=s, block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=steps,
                grid_block_n=gbn), (xs, ws, sizes), gflops, log,
                f"mosaic ragged_dot bm {bm} bn {bn} bk 64, {steps} stages, grid_block_n {gbn}")
            rows.append(_against(r, ref, "lax", log))
    except Exception as e:  # noqa: BLE001
        log(f"ragged_dot_mgpu unavailable: {type(e).__name__}: {e}")
    for r in rows:
        r.pop("out", None)
    json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows}, open(a.json, "w"),
              indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
