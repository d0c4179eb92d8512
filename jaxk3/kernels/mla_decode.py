"""Absorbed MLA decode attention over the latent cache, split over the context (flash-decoding),
as a Pallas kernel beside its jnp reference `latent_attention`.

The reference scores every cache slot of every head at once ([B, H, S] scores, a softmax, a second
pass over the cache); at long contexts XLA runs that as a few kernels with little parallelism over S.
Here the cache's S slots are cut into `splits` parts, and a grid program per (row, head group,
part) walks its part in blocks of BLOCK_S slots with an online softmax (running max m, sum l,
weighted sum acc of c_kv), reading each cache entry once for its head group; slots past the row's
length are skipped.  A short jnp step merges the parts (log-sum-exp).  float32 throughout, as in
the reference; the sums run in another order, so results agree to float32 rounding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels.registry import Kernel, interpret_only, register

F32 = jnp.float32
BLOCK_S = 64  # cache slots per inner step
SPLIT = 1024  # cache slots per grid program (parts = ceil(S / SPLIT))
BLOCK_H = 64  # heads per grid program (padded to a power of two >= 16 for the dots)
NEG = -1e30  # a finite "minus infinity": exp(NEG - m) is 0 without inf - inf


def latent_attention(ql_BHR: jax.Array, qpe_BHP: jax.Array, kv_BSR: jax.Array, length_B: jax.Array,
                     scale: float) -> jax.Array:
    """Absorbed decode attention over the latent cache, fp32 [B, H, R]: every head's softmax over slots
    t <= length_B of (ql·c_kv_t + q_pe·k_pe_t)·scale, applied to c_kv.  The `mla_decode` kernel's
    reference (R = kv_lora_rank: the first R of each cache entry are c_kv, the rest k_pe)."""
    S, R = kv_BSR.shape[1], ql_BHR.shape[-1]
    c_BSR = kv_BSR.astype(F32)
    score_BHS = (jnp.einsum("bhr,bsr->bhs", ql_BHR, c_BSR[..., :R])
                 + jnp.einsum("bhp,bsp->bhs", qpe_BHP, c_BSR[..., R:])) * scale
    mask_BS = jnp.arange(S)[None, :] <= length_B[:, None]
    score_BHS = jnp.where(mask_BS[:, None, :], score_BHS, -jnp.inf)
    p_BHS = jax.nn.softmax(score_BHS, axis=-1)
    return jnp.einsum("bhs,bsr->bhr", p_BHS, c_BSR[..., :R])


_HI = jax.lax.Precision.HIGHEST  # float32 dots (not TF32), as the reference


def _dot_t(a, b):
    """a [M, K] @ b[N, K].T -> [M, N] in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=F32)


def _kernel(len_ref, ql_ref, qpe_ref, kv_ref, m_ref, l_ref, acc_ref, *, R: int, P: int, S: int, split: int,
            scale: float):
    from jax.experimental import pallas as pl

    b, hg, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = len_ref[b]
    ql, qpe = ql_ref[b, hg], qpe_ref[b, hg]  # [Hb, R], [Hb, P]
    Hb = ql.shape[0]
    start = part * split
    steps = jnp.clip((jnp.minimum(length + 1, S) - start + BLOCK_S - 1) // BLOCK_S, 0, split // BLOCK_S)

    def body(i, carry):
        m, l, acc = carry
        pos = start + i * BLOCK_S
        c = kv_ref[b, pl.ds(pos, BLOCK_S), pl.ds(0, R)].astype(F32)  # [BS, R]
        kpe = kv_ref[b, pl.ds(pos, BLOCK_S), pl.ds(R, P)].astype(F32)  # [BS, P]
        s = (_dot_t(ql, c) + _dot_t(qpe, kpe)) * scale  # [Hb, BS]
        ok = (pos + jnp.arange(BLOCK_S))[None, :] <= length
        s = jnp.where(ok, s, NEG)
        c = jnp.where(ok.reshape(BLOCK_S, 1), c, 0.0)  # slots past the length: never part of the sum
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + jnp.dot(p, c, precision=_HI)

    init = (jnp.full((Hb,), NEG, F32), jnp.zeros((Hb,), F32), jnp.zeros((Hb, R), F32))
    m, l, acc = jax.lax.fori_loop(0, steps, body, init)
    m_ref[b, hg, part] = m
    l_ref[b, hg, part] = l
    acc_ref[b, hg, part] = acc


def mla_decode(ql_BHR, qpe_BHP, kv_BSR, length_B, scale: float, interpret: bool = False) -> jax.Array:
    """The same function as the reference: fp32 [B, H, R]."""
    from jax.experimental import pallas as pl

    B, H, R = ql_BHR.shape
    S, P = kv_BSR.shape[1], qpe_BHP.shape[-1]
    Hb = min(BLOCK_H, max(16, 1 << (H - 1).bit_length()))
    G = -(-H // Hb)
    split = min(SPLIT, S)
    parts = S // split

    def heads(x):  # [B, H, X] -> [B, G, Hb, X], padded heads score 0 and are dropped below
        x = jnp.pad(x.astype(F32), ((0, 0), (0, G * Hb - H), (0, 0)))
        return x.reshape(B, G, Hb, x.shape[-1])

    any_ = pl.BlockSpec(memory_space=pl.ANY)
    m, l, acc = pl.pallas_call(
        functools.partial(_kernel, R=R, P=P, S=S, split=split, scale=scale), grid=(B, G, parts),
        in_specs=[any_] * 4, out_specs=[any_] * 3,
        out_shape=(jax.ShapeDtypeStruct((B, G, parts, Hb), F32), jax.ShapeDtypeStruct((B, G, parts, Hb), F32),
                   jax.ShapeDtypeStruct((B, G, parts, Hb, R), F32)),
        interpret=interpret,
    )(length_B.astype(jnp.int32), heads(ql_BHR), heads(qpe_BHP), kv_BSR)
    w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))  # parts past the length: m = NEG, weight 0
    out = jnp.sum(w[..., None] * acc, axis=2) / jnp.sum(w * l, axis=2)[..., None]
    return out.reshape(B, G * Hb, R)[:, :H]


def reference(ql_BHR, qpe_BHP, kv_BSR, length_B, scale):
    return latent_attention(ql_BHR, qpe_BHP, kv_BSR, length_B, scale)


def fits(ql_BHR, qpe_BHP, kv_BSR, length_B, scale, **_) -> str | None:
    R, P, S = ql_BHR.shape[-1], qpe_BHP.shape[-1], kv_BSR.shape[1]
    for name, n in (("kv_lora_rank", R), ("qk_rope_head_dim", P)):
        if n & (n - 1) or n < 16:
            return f"mla_decode kernel needs {name} a power of two >= 16 (Triton blocks), got {n}"
    if S % BLOCK_S or (S > SPLIT and S % SPLIT):
        return f"mla_decode kernel needs the cache length a multiple of {BLOCK_S} (and of {SPLIT} above it), got {S}"
    return None


register(Kernel("mla_decode", reference, mla_decode, platforms=("gpu",), fits=fits,
                unproven=interpret_only("test_mla_decode_kernel_on_gpu")))
