"""`jaxk3 bench kernels`: each device kernel against the XLA path it replaces, same run, real sizes.

moe_experts (jaxk3.kernels.moe_experts): the routed experts of one MoE decode step on one TP rank
of a real config (default: K3 at TP 2, so w1/w3 are [E, 1536, 3584] and w2 [E, 3584, 1536] per
rank), for dense bf16 and MXFP4 experts, at each batch.  Baselines in the same run: the jnp
reference on the same weights (XLA's fused gather-multiply-sum; for MXFP4 the dequantisation is
written in jnp and fused by XLA), and the dense-bf16 reference of the same logical matrices.

Per case: the median over `repeats` of (wall time of `chain` dependent calls / chain) after a
warm-up, the bytes of expert weights a call must read (the distinct selected experts, packed bytes
for MXFP4), and the bandwidth those bytes imply.  `--experts` keeps fewer experts per layer
(memory): only the selected ones are read, so the per-call work is unchanged while E >= B·k.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxk3.config import KimiK3Config


def _timed(fn, args, chain: int, repeats: int) -> float:
    """Median seconds per call: `chain` calls, each fed the previous output (no host round trip)."""
    def run(z, *rest):
        def body(_, z):
            return fn(z, *rest).astype(z.dtype) + z
        return jax.lax.fori_loop(0, chain, body, z)

    f = jax.jit(run)
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append((time.perf_counter() - t0) / chain)
    return statistics.median(times)


def moe_experts_cases(cfg: KimiK3Config, tp: int, experts: int, batches: tuple[int, ...], chain: int, repeats: int,
                      seed: int = 0, configs=(None,), layout: str = "checkpoint",
                      formats: tuple[str, ...] = ("bf16", "mxfp4")) -> list[dict[str, Any]]:
    """Rows of {format, batch, path, us, bytes, GB/s, x_vs_reference, x_vs_dense_reference}; one kernel row per
    moe_experts.Config in `configs` (None: the default; path "kernel", else "kernel <config>"), for each of
    `formats` ("bf16", "mxfp4"; x_vs_bf16_xla is None without the bf16 rows).  `layout`
    "serving": w1 | w3 joined as the serving layout stores them, and (bf16, a config whose routed experts read
    the hidden state: Kimi-Linear) the shared experts fused in the kernel, their bytes counted."""
    from jaxk3 import kernels, params
    from jaxk3.kernels.moe_experts import SharedMLP, plan
    from jaxk3.layers import moe

    E, I, L = experts, cfg.moe_intermediate_size // tp, cfg.moe_hidden
    k = cfg.num_experts_per_token
    key = jax.random.key(seed)
    ks = jax.random.split(key, 10)
    dense = moe.MoEWeights(
        gate=None, e_score_correction_bias=None,
        experts_w1=(jax.random.normal(ks[0], (E, I, L), jnp.float32) * 0.02).astype(jnp.bfloat16),
        experts_w2=(jax.random.normal(ks[1], (E, L, I), jnp.float32) * 0.02).astype(jnp.bfloat16),
        experts_w3=(jax.random.normal(ks[2], (E, I, L), jnp.float32) * 0.02).astype(jnp.bfloat16))

    def packed(kk, O, In):
        return moe.MXFP4(jax.random.bits(kk, (E, O, In // 2), jnp.uint8),
                         jax.random.randint(kk, (E, O, In // 32), 119, 122, jnp.int32).astype(jnp.uint8))
    mx = dataclasses.replace(dense, experts_w1=packed(ks[3], I, L), experts_w2=packed(ks[4], L, I),
                             experts_w3=packed(ks[5], I, L))
    mx = moe.with_f16(mx, moe.f16_exact(mx))  # as the loader marks them (checkpoint.mark_experts_f16)
    shared = None
    if layout == "serving":
        dense, mx = params.serve_local(dense), params.serve_local(mx)
        if cfg.routed_expert_hidden_size is None and cfg.num_shared_experts and cfg.shared_intermediate_size // tp == I:
            shared = SharedMLP((jax.random.normal(ks[8], (2 * I, L), jnp.float32) * 0.02).astype(jnp.bfloat16),
                               (jax.random.normal(ks[9], (L, I), jnp.float32) * 0.02).astype(jnp.bfloat16))
    elif layout != "checkpoint":
        raise ValueError(f"layout: 'checkpoint' or 'serving', got {layout!r}")
    kcfg = dataclasses.replace(cfg, num_experts=E)
    interpret = jax.devices()[0].platform == "cpu"  # CPU: Pallas interpret mode (plumbing only, not speed)
    ker = functools.partial(kernels.REGISTRY["moe_experts"].device, interpret=interpret)
    ref, fits = kernels.REGISTRY["moe_experts"].reference, kernels.REGISTRY["moe_experts"].fits
    rows = []
    for B in batches:
        z = jax.random.normal(ks[6], (B, L), jnp.float32).astype(jnp.bfloat16)
        # k distinct experts per token, drawn independently per token (duplicates across tokens, as routed)
        ids = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(ks[7], B)).astype(jnp.int32)
        wk = jnp.full((B, k), 1.0 / k, jnp.float32)
        distinct = int(np.sum(np.asarray(plan(ids, wk, E)[0]) >= 0))
        base = None
        for fmt, w in (("bf16", dense), ("mxfp4", mx)):
            if fmt not in formats:
                continue
            per_expert = sum(a[0].nbytes for a in jax.tree.leaves((w.experts_w1, w.experts_w2, w.experts_w3,
                                                                    w.experts_w13)))
            sh = shared if fmt == "bf16" else None
            nbytes = distinct * per_expert + (sh.gate_up.nbytes + sh.down.nbytes if sh is not None else 0)
            paths = [("xla", functools.partial(ref, shared=sh))] + [
                ("kernel" if c is None else f"kernel {c}", functools.partial(ker, config=c, shared=sh))
                for c in configs]
            want = None
            for path, fn in paths:
                try:
                    why = path.startswith("kernel") and fits(kcfg, w, z, wk, ids, config=fn.keywords["config"],
                                                             shared=sh, only_where_faster=False)
                    if why:
                        raise ValueError(why)
                    got = np.asarray(jax.jit(lambda z, w, wk, ids, fn=fn: fn(kcfg, w, z, wk, ids))(z, w, wk, ids),
                                     np.float64)
                    us = _timed(lambda z, w, wk, ids, fn=fn: fn(kcfg, w, z, wk, ids), (z, w, wk, ids), chain,
                                repeats) * 1e6
                except Exception as e:  # a swept config that does not fit or compile (shared memory) is a row
                    if not path.startswith("kernel"):
                        raise
                    rows.append(dict(kernel="moe_experts", format=fmt, batch=B, path=path, error=str(e)[:500]))
                    continue
                want = got if want is None else want
                if fmt == "bf16" and path == "xla":
                    base = us
                rows.append(dict(kernel="moe_experts", format=fmt, batch=B, path=path, us=us, bytes=nbytes,
                                 gbps=nbytes / us / 1e3, distinct_experts=distinct,
                                 x_vs_bf16_xla=base / us if base else None,
                                 layout=layout, shared=sh is not None,
                                 rel_err=float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))))
    return rows


def bench_kernels(config: str = "k3", tp: int = 2, experts: int = 64, batches: tuple[int, ...] = (1, 8),
                  chain: int = 20, repeats: int = 5) -> dict[str, Any]:
    from jaxk3.tools import bench_decode as bd

    cfg = bd.load_config(config)
    if "moe" not in cfg.layer_ffn:
        raise ValueError(f"--config {config}: no MoE layer, nothing to benchmark")
    if cfg.moe_intermediate_size % tp:
        raise ValueError(f"--tp {tp}: moe_intermediate_size {cfg.moe_intermediate_size} does not split")
    if experts < cfg.num_experts_per_token:
        raise ValueError(f"--experts {experts}: fewer than the {cfg.num_experts_per_token} experts per token")
    rows = moe_experts_cases(cfg, tp, min(experts, cfg.num_experts), batches, chain, repeats)
    dev = jax.devices()[0]
    return dict(device=f"{dev.platform} {dev.device_kind}" + (" (Pallas interpret mode: times are not kernel speed)"
                                                              if dev.platform == "cpu" else ""),
                jax=jax.__version__, config=config, tp=tp,
                experts=min(experts, cfg.num_experts), rows=rows)


def format_rows(res: dict[str, Any]) -> str:
    out = [f"# bench kernels: {res['device']}, jax {res['jax']}, {res['config']} at TP {res['tp']} "
           f"({res['experts']} experts per layer kept)",
           f"{'kernel':<12} {'fmt':<6} {'B':>3} {'path':<7} {'us':>9} {'MB read':>9} {'GB/s':>8} {'x bf16 xla':>10}"]
    for r in res["rows"]:
        out.append(f"{r['kernel']:<12} {r['format']:<6} {r['batch']:>3} {r['path']:<7} {r['us']:>9.1f} "
                   f"{r['bytes'] / 1e6:>9.1f} {r['gbps']:>8.0f} {r['x_vs_bf16_xla']:>10.2f}")
    return "\n".join(out)
