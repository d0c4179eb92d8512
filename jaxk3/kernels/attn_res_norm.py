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
from jax import lax

from jaxk3.kernels.rms_norm import rms_norm

F32 = jnp.float32
# The stack's form in the compiled step at decode.  False, and always for more than SELECT_MAX_ROWS rows (prefill, not
# timed with it): `jnp.stack` (a concatenate) and the mix as an einsum over the depth.  True: the stack built
# element-wise by selects on the depth index and the mix as a sum of the weighted sources, so that XLA fuses the
# sources' producers (a block's o_proj partial sums, the stream's add) into the kernels that read the stack: K3 layers
# 11-14 packed at B = 1 compiles to 176 launches instead of 191 and timed 3204.9 us against 3224.9 / 3220.9 without it
# in the same call on an H100; at B = 8 even (4129.4 against 4120.1 / 4122.9) (docs/PERF.md, twenty-ninth session).
# The same values: bitwise on the CPU (tests/test_layers.py); on a GPU the mix's float32 sum may run in another order.
SELECT_STACK = True
SELECT_MAX_ROWS = 8


def _selects(sources: Sequence[jax.Array]) -> bool:
    return SELECT_STACK and len(sources) > 1 and sources[0].shape[0] <= SELECT_MAX_ROWS


def _stack(sources: Sequence[jax.Array]) -> jax.Array:
    """[N, B, D] fp32 of the N sources: a concatenate, or (`_selects`) selects on the depth index."""
    if not _selects(sources):
        return jnp.stack([s.astype(F32) for s in sources], axis=0)
    n_NBD = lax.broadcasted_iota(jnp.int32, (len(sources),) + sources[0].shape, 0)
    s_NBD = jnp.broadcast_to(sources[-1].astype(F32)[None], n_NBD.shape)
    for i in range(len(sources) - 2, -1, -1):
        s_NBD = jnp.where(n_NBD == i, sources[i].astype(F32)[None], s_NBD)
    return s_NBD


def attn_res(sources: Sequence[jax.Array], w_norm_D: jax.Array, w_proj_D: jax.Array, eps: float) -> jax.Array:
    """Mix N sources (each `[B, D]`, any float dtype) with depth-softmax weights; returns h_BD fp32.

    `w_proj_D` may be given as the checkpoint's `[1, D]`; it is flattened.
    """
    s_NBD = _stack(sources)
    if len(sources) == 1:
        return s_NBD[0]
    logit_NB = jnp.einsum("nbd,d->nb", rms_norm(s_NBD, w_norm_D, eps), w_proj_D.reshape(-1).astype(F32))
    alpha_NB = jax.nn.softmax(logit_NB, axis=0)
    if _selects(sources):
        return jnp.sum(alpha_NB[:, :, None] * s_NBD, axis=0)
    return jnp.einsum("nb,nbd->bd", alpha_NB, s_NBD)


def mix_norm(sources: Sequence[jax.Array], res_norm, res_proj, ln_w_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm(AttnRes(sources); ln_w) in fp32 [B, D] (a block's normed input); without AttnRes
    weights (Kimi-Linear) the one source is normed as it is."""
    h = sources[0] if res_norm is None else attn_res(sources, res_norm, res_proj, eps)
    return rms_norm(h, ln_w_D, eps)
