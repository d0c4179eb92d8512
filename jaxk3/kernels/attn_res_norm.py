"""The AttnRes depth mix (`attn_res`, docs/SPEC.md §3.1) and a block's normed input
RMSNorm(AttnRes(sources); w) (`mix_norm`); the residual stream that uses them is
jaxk3.layers.attn_res, and the model calls `mix_norm` for every block's input norm.

No device kernel: the fused Pallas kernel that was here (one program per row, three passes over D)
lost to XLA at K3, the only preset with AttnRes (0.64-0.74x, 9 sources, D 7168, B 1 and 8), and tied
at Kimi-Linear's plain RMSNorm (0.99-1.17x) on an H200 (docs/PERF.md, issue 22), so it was removed.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from jaxk3.kernels.rms_norm import rms_norm

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


def mix_norm(sources: Sequence[jax.Array], res_norm, res_proj, ln_w_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm(AttnRes(sources); ln_w) in fp32 [B, D] (a block's normed input); without AttnRes
    weights (Kimi-Linear) the one source is normed as it is."""
    h = sources[0] if res_norm is None else attn_res(sources, res_norm, res_proj, eps)
    return rms_norm(h, ln_w_D, eps)
