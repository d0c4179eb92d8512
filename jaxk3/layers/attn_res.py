"""Block Attention Residuals (spec §3.1): a softmax over depth replaces `x + residual` in K3.

    r_i     = rsqrt(mean(s_i²) + eps)
    logit_i = Σ_d s_i[d]·r_i·w_norm[d]·w_proj[d]        (= w_proj · RMSNorm(s_i; w_norm))
    α       = softmax_i(logit)                           over the N depth sources
    h       = Σ_i α_i s_i                                mixes the UN-normalised sources

All in fp32.  Nothing is cached across decode steps: AttnRes mixes over depth, not time.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from jaxk3.layers.norm import rms_norm

F32 = jnp.float32


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
