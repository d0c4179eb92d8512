"""A block's normed input, RMSNorm(AttnRes(sources); w), as one Pallas kernel beside its jnp
reference `mix_norm`, and the AttnRes mix itself (`attn_res`, docs/SPEC.md §3.1; the residual stream
that uses it is jaxk3.layers.attn_res).

XLA runs the depth mix and the norm after it as a chain of small kernels with grids of 1-4 blocks
(the N source norms, the logits, the softmax over depth, the weighted sum, the RMSNorm).  Here one
grid program owns one row: it walks the hidden dimension in power-of-two chunks three times
(1: each source's sum of squares and its logit term; 2: the mix's sum of squares; 3: the normed
mix, written once), reading the N sources straight from where they are (no stacked copy).
Everything is float32 as in the reference; sums run chunk by chunk, so results agree to float32
rounding (tests/test_kernels.py).  Without AttnRes weights (Kimi-Linear) it is the RMSNorm alone.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxk3.kernels.registry import Kernel, interpret_only, register
from jaxk3.kernels.rms_norm import rms_norm

F32 = jnp.float32
MAX_CHUNK = 1024


def attn_res(sources: Sequence[jax.Array], w_norm_D: jax.Array, w_proj_D: jax.Array, eps: float) -> jax.Array:
    """Mix N sources (each `[B, D]`, any float dtype) with depth-softmax weights; returns h_BD fp32.

    `w_proj_D` may be given as the checkpoint's `[1, D]`; it is flattened.
    """
    s_NBD = jnp.stack([s.astype(F32) for s in sources], axis=0)
    if len(sources) == 1:
        return s_NBD[0]
    logit_NB = jnp.einsum("nbd,d->nb", rms_norm(s_NBD, w_norm_D, eps), w_proj_D.reshape(-1).astype(F32))
    alpha_NB = jax.nn.softmax(logit_NB, axis=0)
    return jnp.einsum("nb,nbd->bd", alpha_NB, s_NBD)


def mix_norm(sources: Sequence[jax.Array], res_norm, res_proj, ln_w_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm(AttnRes(sources); ln_w) in fp32 [B, D] (a block's normed input); without AttnRes
    weights (Kimi-Linear) the one source is normed as it is.  The jnp reference of `attn_res_norm`."""
    h = sources[0] if res_norm is None else attn_res(sources, res_norm, res_proj, eps)
    return rms_norm(h, ln_w_D, eps)


def _chunk(D: int) -> int:
    """The largest power of two <= MAX_CHUNK dividing D (7168 -> 1024, 2304 -> 256)."""
    c = MAX_CHUNK
    while D % c:
        c //= 2
    return c


def _kernel(*refs, n: int, D: int, chunk: int, eps: float, mix: bool):
    from jax.experimental import pallas as pl

    srcs, (wn_ref, wp_ref, ln_ref, o_ref) = refs[:n], refs[n:]
    b = pl.program_id(0)
    steps = D // chunk

    def col(i):
        return pl.ds(i * chunk, chunk)

    if mix:
        def stats(i, acc):
            ss, dots = acc
            wv = wn_ref[col(i)].astype(F32) * wp_ref[col(i)].astype(F32)
            xs = [s[b, col(i)].astype(F32) for s in srcs]
            return (tuple(a + jnp.sum(x * x) for a, x in zip(ss, xs)),
                    tuple(a + jnp.sum(x * wv) for a, x in zip(dots, xs)))

        zero = tuple(jnp.float32(0) for _ in range(n))
        ss, dots = jax.lax.fori_loop(0, steps, stats, (zero, zero))
        logits = [d * jax.lax.rsqrt(s / D + eps) for s, d in zip(ss, dots)]
        m = functools.reduce(jnp.maximum, logits)
        ex = [jnp.exp(x - m) for x in logits]
        tot = functools.reduce(lambda a, c: a + c, ex)
        alpha = [e / tot for e in ex]
    else:
        alpha = [jnp.float32(1)]

    def mixed(i):
        h = alpha[0] * srcs[0][b, col(i)].astype(F32) if mix else srcs[0][b, col(i)].astype(F32)
        for a, s in zip(alpha[1:], srcs[1:]):
            h = h + a * s[b, col(i)].astype(F32)
        return h

    hh = jax.lax.fori_loop(0, steps, lambda i, acc: acc + jnp.sum(mixed(i) ** 2), jnp.float32(0))
    r = jax.lax.rsqrt(hh / D + eps)

    def write(i, carry):
        o_ref[b, col(i)] = ln_ref[col(i)].astype(F32) * mixed(i) * r
        return carry

    jax.lax.fori_loop(0, steps, write, 0)


def attn_res_norm(sources, res_norm, res_proj, ln_w_D, eps: float, interpret: bool = False) -> jax.Array:
    """The same function as the reference: fp32 [rows, D]."""
    from jax.experimental import pallas as pl

    rows, D = sources[0].shape
    mix = res_norm is not None
    n = len(sources) if mix else 1
    srcs = list(sources[:n])
    wn = res_norm if mix else ln_w_D
    wp = res_proj.reshape(-1) if mix else ln_w_D
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, n=n, D=D, chunk=_chunk(D), eps=eps, mix=mix and n > 1),
        grid=(rows,), in_specs=[any_] * (n + 3), out_specs=any_,
        out_shape=jax.ShapeDtypeStruct((rows, D), F32), interpret=interpret,
    )(*srcs, wn, wp, ln_w_D)


reference = mix_norm


def fits(sources, res_norm, res_proj, ln_w_D, eps, **_) -> str | None:
    shapes = {tuple(s.shape) for s in sources}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        return f"attn_res_norm kernel takes sources of one [rows, D] shape, got {sorted(shapes)}"
    D = sources[0].shape[1]
    if D % 64:
        return f"attn_res_norm kernel needs D a multiple of 64 (power-of-two chunks), got {D}"
    return None


register(Kernel("attn_res_norm", reference, attn_res_norm, platforms=("gpu",), fits=fits,
                unproven=interpret_only("test_attn_res_norm_kernel_on_gpu")))
