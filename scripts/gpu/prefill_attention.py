"""The prefill's attention blocks at Kimi-Linear-48B dimensions on one GPU, each against the path it
replaces, in the same run:

  mla   the absorbed causal attention over the latent cache (32 heads, 512 + 64 latent): the jnp path
        (`latent_attention_prefill`, XLA: fp32 [B, T, H, S] scores) against the `mla_prefill` kernel's
        configs; a 4096-token fresh prompt (B = 1) and a 1024-token chunk after a 3072-slot prefix (B = 8)
  kda   the chunked delta rule (32 heads, 128 x 128 state): the former form (one lax.scan step per
        64-token chunk, ~35 kernels each; kept here as `scan_form`) against today's `chunk_delta_rule`
        (every chunk at once, one product and add per chunk in sequence)

Per row: ms per call (median of REPS x INNER calls), the ratio to the replaced path, and the relative
error against it (max |a - b| / max |b|).

    python scripts/gpu/prefill_attention.py [--json PATH] [--only mla,kda]
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

from jaxk3.kernels import mla_prefill as M  # noqa: E402
from jaxk3.layers import kda  # noqa: E402

INNER, REPS = 3, 5
F32 = jnp.float32
MLA_CONFIGS = [M.Config(), M.Config(bm=64, bn=32, num_warps=8, num_stages=3), M.Config(bm=32, bn=32, num_warps=4),
               M.Config(bm=64, bn=16, num_warps=8), M.Config(bm=32, bn=64, num_warps=4),
               M.Config(bm=64, bn=64, num_warps=8, num_stages=1)]


def scan_form(q, k, v, g, beta, state, chunk: int = 64):
    """The chunked delta rule as it was before (jaxk3 at 8ba18af): one lax.scan step per chunk."""
    B, H, T, K = q.shape
    C = min(chunk, T)
    n = T // C

    def split(a):
        return jnp.moveaxis(a.reshape(B, H, n, C, *a.shape[3:]), 2, 0)

    causal = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)

    def one_chunk(S, xs):
        q, k, v, g, beta = xs
        G = jnp.cumsum(g, axis=2)
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]
        decay = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))
        A = jnp.einsum("bhtc,bhsc,bhtsc->bhts", k, k, decay) * beta[..., None]
        A = jnp.where(strict, A, 0.0)
        rhs = beta[..., None] * (v - jnp.einsum("bhtk,bhkv->bhtv", jnp.exp(G) * k, S))
        u = jnp.einsum("bhts,bhsv->bhtv", kda._unit_lower_inverse(A), rhs)
        Mm = jnp.einsum("bhtc,bhsc,bhtsc->bhts", q, k, decay)
        o = jnp.einsum("bhtk,bhkv->bhtv", jnp.exp(G) * q, S) + jnp.einsum("bhts,bhsv->bhtv", Mm, u)
        last = G[:, :, -1:, :]
        S = jnp.exp(last[:, :, 0, :])[..., None] * S + jnp.einsum("bhsk,bhsv->bhkv", jnp.exp(last - G) * k, u)
        return S, o

    S, o = jax.lax.scan(one_chunk, state.astype(F32), tuple(split(a.astype(F32)) for a in (q, k, v, g, beta)))
    return jnp.moveaxis(o, 0, 2).reshape(B, H, T, -1), S


def rel(a, b) -> float:
    a, b = (np.asarray(x, np.float64) for x in (a, b))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def run_paths(paths, args, label, log, rows):
    base = want = None
    for name, f in paths:
        try:
            t = timing.per_call(f, args, reps=REPS, inner=INNER, chain=1)
            got = jax.tree.leaves(f(*args))[0]
        except Exception as e:  # a config that does not compile is a row, not the end of the run
            log(f"{label} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(case=label, path=name, error=str(e)[:2000]))
            continue
        if base is None:
            base, want = t, got
        err = rel(got, want)
        log(f"{label} {name:58s} {t * 1e3:8.3f} ms  {base / t:5.2f}x  rel err {err:.1e}")
        rows.append(dict(case=label, path=name, ms=t * 1e3, speedup=base / t, rel_err=err))


def mla_cases(log, rows):
    H, R, P, scale = 32, 512, 64, (128 + 64) ** -0.5
    for B, T, prefix in ((1, 4096, 0), (8, 1024, 3072)):
        S = prefix + T
        r = np.random.default_rng(B)
        ql = jnp.asarray(r.standard_normal((B, T, H, R)) * 0.05, F32)  # scores of O(1) at these widths
        qpe = jnp.asarray(r.standard_normal((B, T, H, P)) * 0.05, F32)
        kv = jnp.asarray(r.standard_normal((B, S, R + P)), jnp.bfloat16)
        limit = jnp.asarray(np.broadcast_to(prefix + np.arange(T), (B, T)), jnp.int32)
        flops = 2.0 * B * H * sum(prefix + t + 1 for t in range(T)) * (R + P + R)
        paths = [("xla (latent_attention_prefill)", jax.jit(lambda *a: M.latent_attention_prefill(*a, scale)))]
        for c in MLA_CONFIGS:
            why = M.fits(ql, qpe, kv, limit, scale, config=c)
            if why:
                log(f"mla B {B} T {T}: {c} skipped ({why})")
                continue
            paths.append((f"kernel {c}", jax.jit(lambda *a, c=c: M.mla_prefill(*a, scale, config=c))))
        label = f"mla B {B} T {T} prefix {prefix} ({flops / 1e9:.0f} GFLOP causal)"
        run_paths(paths, (ql, qpe, kv, limit), label, log, rows)


def kda_cases(log, rows):
    H, K = 32, 128
    for B, T in ((1, 4096), (8, 1024)):
        r = np.random.default_rng(T)
        k = r.standard_normal((B, H, T, K))
        args = (jnp.asarray(r.standard_normal((B, H, T, K)) * K ** -0.5, F32),
                jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), F32),
                jnp.asarray(r.standard_normal((B, H, T, K)), F32),
                jnp.asarray(-np.abs(r.standard_normal((B, H, T, K))) * 0.1, F32),
                jnp.asarray(r.uniform(0, 1, (B, H, T)), F32), jnp.zeros((B, H, K, K), F32))
        paths = [("scan form (before)", jax.jit(scan_form)), ("chunk_delta_rule (now)", jax.jit(kda.chunk_delta_rule))]
        run_paths(paths, args, f"kda B {B} T {T}", log, rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="out/prefill_attention.json")
    ap.add_argument("--only", default="mla,kda")
    a = ap.parse_args(argv)
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    log = timing.logger(a.json)
    log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; Kimi-Linear-48B attention dims")
    rows = []
    if "kda" in a.only:
        kda_cases(log, rows)
    if "mla" in a.only:
        mla_cases(log, rows)
    with open(a.json, "w") as fh:
        json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
