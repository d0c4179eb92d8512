"""The prefill's attention blocks at Kimi-Linear-48B dimensions on one GPU, each against the path it
replaces, in the same run:

  mla   the causal attention over the latent cache (32 heads, 128 nope / 128 v, 512 + 64 latent), W_UK and W_UV
        included: the jnp path (`attention`, XLA: absorbed, fp32 [B, T, H, S] scores) against the `mla_prefill`
        kernel's configs in both forms (absorbed; per head, keys and values expanded from the latents); a
        4096-token fresh prompt (B = 1) and a 1024-token chunk after a 3072-slot prefix (B = 8)
  kda   the chunked delta rule (32 heads, 128 x 128 state): the model's `chunk_delta_rule` (one lax.scan
        step per 64-token chunk, ~35 kernels each) against the all-chunks form tried on 2026-12-02
        (`allchunks_form`: every chunk at once, one product and add per chunk in sequence) and the
        `kda_prefill` kernel path (every chunk's operands from XLA, then the state-pass kernel) in a few
        configs, and the state pass alone in more

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
from jaxk3.kernels import kda_prefill as KP  # noqa: E402

INNER, REPS = 3, 5
F32 = jnp.float32
MLA_CONFIGS = [M.Config(), M.Config(bm=64, bn=64, num_warps=8, num_stages=1), M.Config(bm=32, bn=64, num_warps=4, num_stages=3),
               M.Config(form="heads"), M.Config(form="heads", bm=64, bn=64), M.Config(form="heads", bm=64, bn=64, num_warps=8),
               M.Config(form="heads", bm=128, bn=64, num_warps=8), M.Config(form="heads", bm=64, bn=32, num_stages=3)]


# The chunked delta rule with every chunk's intra-chunk work at once (jaxk3 at c2c7347, tried on
# 2026-12-02 and not kept: 1.64x faster than the scan form alone, 4x slower inside the 48B prefill).
def allchunks_form(q_BHTK: jax.Array, k_BHTK: jax.Array, v_BHTV: jax.Array, g_BHTK: jax.Array,
                     beta_BHT: jax.Array, state_BHKV: jax.Array, chunk: int = 64, sub: int = 16
                     ) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over T tokens in chunks (the WY / UT-transform form), fp32.

    Equal to T recurrent steps `S ← diag(e^g) S; u = β(v − Sᵀk); S ← S + k uᵀ; o = Sᵀq` (q already
    scaled).  Within a chunk, with Γ_t = Σ_{s≤t} g_s (per key channel) and S_0 the incoming state:

        A[t,s] = β_t Σ_c k_t[c] k_s[c] e^{Γ_t[c]−Γ_s[c]}     s < t   (strictly lower)
        M[t,s] =     Σ_c q_t[c] k_s[c] e^{Γ_t[c]−Γ_s[c]}     s ≤ t
        (I + A) u = β ⊙ (v − (e^Γ ⊙ k) S_0)                      (unit lower-triangular: _unit_lower_inverse)
        o_t    = (e^{Γ_t} ⊙ q_t) S_0 + Σ_{s≤t} M[t,s] u_s
        S_C    = diag(e^{Γ_C}) S_0 + Σ_s diag(e^{Γ_C−Γ_s}) k_s u_sᵀ

    Everything but S_0 is known per chunk, so with W = (I + A)⁻¹ the chunk is affine in S_0:

        u = U0 − Wk S_0,          U0 = W (β ⊙ v),  Wk = W (β ⊙ e^Γ ⊙ k)
        o = Qe S_0 + O0,          Qe = e^Γ ⊙ q − M Wk,  O0 = M U0
        S_C = Tc S_0 + Hc,        Tc = diag(e^{Γ_C}) − (e^{Γ_C−Γ} ⊙ k)ᵀ Wk,  Hc = (e^{Γ_C−Γ} ⊙ k)ᵀ U0

    These are computed for all chunks at once (batched products); only S_{j+1} = Tc_j S_j + Hc_j runs
    in sequence (one product and add per chunk), then o for all chunks at once.  A and M come from
    `_decayed_pairs` (sub-chunks of `sub` tokens: no exponential of a positive sum, whatever the gates).
    T must be a multiple of min(chunk, T).  Returns (o_BHTV, final state_BHKV).
    """
    B, H, T, K = q_BHTK.shape
    C = min(chunk, T)
    if T % C:
        raise ValueError(f"chunk_delta_rule: T={T} is not a multiple of the chunk {C}")
    c = sub if C % sub == 0 else C  # a chunk that sub does not divide is one diagonal block (exact, more exps)
    n = T // C
    q, k, v, g = (a.astype(F32).reshape(B, H, n, C, -1) for a in (q_BHTK, k_BHTK, v_BHTV, g_BHTK))
    beta = beta_BHT.astype(F32).reshape(B, H, n, C, 1)
    G = jnp.cumsum(g, axis=3)
    eG = jnp.exp(G)
    G_C = G[:, :, :, -1:, :]  # [B,H,n,1,K]
    A = beta * KP._decayed_pairs(k, k, G, c, strict=True)
    M = KP._decayed_pairs(q, k, G, c, strict=False)
    W = KP._unit_lower_inverse(A)
    U0 = jnp.einsum("bhnts,bhnsv->bhntv", W, beta * v)
    Wk = jnp.einsum("bhnts,bhnsk->bhntk", W, beta * eG * k)
    Qe = eG * q - jnp.einsum("bhnts,bhnsk->bhntk", M, Wk)
    O0 = jnp.einsum("bhnts,bhnsv->bhntv", M, U0)
    kdec = jnp.exp(G_C - G) * k
    Tc = jnp.exp(G_C[:, :, :, 0, :])[..., None] * jnp.eye(K, dtype=F32) - jnp.einsum("bhnsk,bhnsj->bhnkj", kdec, Wk)
    Hc = jnp.einsum("bhnsk,bhnsv->bhnkv", kdec, U0)

    def step(S, TH):
        Tj, Hj = TH
        return jnp.einsum("bhkj,bhjv->bhkv", Tj, S) + Hj, S

    S, S_in = jax.lax.scan(step, state_BHKV.astype(F32), (jnp.moveaxis(Tc, 2, 0), jnp.moveaxis(Hc, 2, 0)))
    o = jnp.einsum("bhntk,nbhkv->bhntv", Qe, S_in) + O0
    return o.reshape(B, H, T, -1), S


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
        err = rel(got, want) if got.shape == want.shape else float("nan")
        log(f"{label} {name:58s} {t * 1e3:8.3f} ms  {base / t:5.2f}x  rel err {err:.1e}")
        rows.append(dict(case=label, path=name, ms=t * 1e3, speedup=base / t, rel_err=err))


def mla_cases(log, rows):
    H, N, V, R, P, scale = 32, 128, 128, 512, 64, (128 + 64) ** -0.5
    for B, T, prefix in ((1, 4096, 0), (8, 1024, 3072)):
        S = prefix + T
        r = np.random.default_rng(B)
        qn = jnp.asarray(r.standard_normal((B, T, H, N)) * 0.3, F32)  # scores of O(1) at these widths
        qpe = jnp.asarray(r.standard_normal((B, T, H, P)) * 0.05, F32)
        kv = jnp.asarray(r.standard_normal((B, S, R + P)), jnp.bfloat16)
        wkvb = jnp.asarray(r.standard_normal((H, N + V, R)) * R ** -0.5, F32)
        limit = jnp.asarray(np.broadcast_to(prefix + np.arange(T), (B, T)), jnp.int32)
        pairs = B * H * sum(prefix + t + 1 for t in range(T))
        paths = [("xla (attention: absorbed, fp32 scores)", jax.jit(lambda *a: M.attention(*a, scale)))]
        for c in MLA_CONFIGS:
            why = M.fits(qn, qpe, kv, limit, wkvb, scale, config=c)
            if why:
                log(f"mla B {B} T {T}: {c} skipped ({why})")
                continue
            paths.append((f"kernel {c}", jax.jit(lambda *a, c=c: M.attention_device(*a, scale, config=c))))
        label = (f"mla B {B} T {T} prefix {prefix} ({2 * pairs * (R + P + R) / 1e9:.0f} GFLOP absorbed, "
                 f"{2 * pairs * (N + P + V) / 1e9:.0f} per head)")
        run_paths(paths, (qn, qpe, kv, limit, wkvb), label, log, rows)


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
        paths = [("chunk_delta_rule (XLA: a scan step per chunk)", jax.jit(KP.chunk_delta_rule)),
                 ("all-chunks form (tried)", jax.jit(allchunks_form))]
        for c in KDA_CONFIGS:
            paths.append((f"kda_prefill {c}", jax.jit(lambda *a, c=c: KP.chunked(*a, config=c))))
        paths.append(("  its operands alone, XLA", jax.jit(lambda *a: KP.chunk_operands(*a[:5], 64).W)))
        ops = jax.jit(lambda *a: KP.chunk_operands(*a[:5], 64))(*args)
        state = []
        for c in STATE_CONFIGS if B == 1 else STATE_CONFIGS[:4]:
            state.append((f"  its state pass alone {c}", jax.jit(lambda o, s, c=c: KP.state_pass(o, s, c)[0])))
        run_paths(paths, args, f"kda B {B} T {T}", log, rows)
        run_paths(state, (ops, args[5]), f"kda B {B} T {T}", log, rows)


# The state pass's configs timed alone (first: IEEE dots' best; 64 x 128 at tf32x3 does not fit shared memory).
STATE_CONFIGS = [KP.Config(block_v=bv, num_warps=w, precision=p)
                 for p, bv, w in (("ieee", 32, 8), ("tf32x3", 32, 8), ("tf32x3", 32, 4), ("tf32x3", 16, 4),
                                  ("tf32x3", 16, 8), ("tf32", 32, 4), ("tf32", 64, 8))]
KDA_CONFIGS = [KP.Config(block_v=32, num_warps=8, precision="ieee"),
               KP.Config(block_v=32, num_warps=8, precision="tf32x3"),
               KP.Config(block_v=32, num_warps=4, precision="tf32x3")]


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
