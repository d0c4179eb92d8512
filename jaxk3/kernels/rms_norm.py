"""RMSNorm of [B, D] rows as one Pallas kernel (a block per row), beside its jnp reference
(`jaxk3.layers.norm.rms_norm`).  The first kernel of the registry: it proves the plumbing
(registration, selection, the interpret-mode test against the reference); the fused kernels of
the decode step join it here."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels import Kernel, register
from jaxk3.layers.norm import rms_norm as reference

F32 = jnp.float32


def _kernel(x_ref, w_ref, o_ref, *, eps: float):
    x = x_ref[...].astype(F32)
    o_ref[...] = (w_ref[...].astype(F32) * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
                  ).astype(o_ref.dtype)


def rms_norm(x_BD: jax.Array, w_D: jax.Array, eps: float, interpret: bool = False) -> jax.Array:
    """The same function as the reference: fp32 [B, D] = w ⊙ x / sqrt(mean(x²) + eps)."""
    from jax.experimental import pallas as pl

    B, D = x_BD.shape
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps), out_shape=jax.ShapeDtypeStruct((B, D), F32), grid=(B,),
        in_specs=[pl.BlockSpec((1, D), lambda i: (i, 0)), pl.BlockSpec((D,), lambda i: (0,))],
        out_specs=pl.BlockSpec((1, D), lambda i: (i, 0)), interpret=interpret)(x_BD, w_D)


def fits(x_BD, w_D, eps, **_) -> str | None:
    if x_BD.ndim != 2 or w_D.shape != x_BD.shape[-1:]:
        return f"rms_norm kernel takes x [B, D] and w [D], got {x_BD.shape} and {w_D.shape}"
    D = x_BD.shape[-1]
    if D & (D - 1) or D > 16384:  # one block per row: Triton blocks are powers of two
        return f"rms_norm kernel needs D a power of two <= 16384, got {D}"
    return None


register(Kernel("rms_norm", reference, rms_norm, platforms=("gpu",), fits=fits))
