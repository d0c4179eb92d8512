"""RMSNorm and gated RMSNorm (docs/SPEC.md §3.0, §3.2 output norm) in fp32: the jnp math every
block uses, and RMSNorm of [B, D] rows as one Pallas kernel (a block per row) beside it.

`RMSNorm(x; w, eps) = w ⊙ x / sqrt(mean(x²) + eps)`: the weight multiplies directly (no 1+w).
Both return fp32; callers cast to the activation dtype where a value is stored.  The kernel is the
registry's first: it proves the plumbing (registration, selection, the interpret-mode test against
the reference)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels.registry import Kernel, register

F32 = jnp.float32


def rms_norm(x_BD: jax.Array, w_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; x and w any float dtype, result fp32 of x's shape."""
    x = x_BD.astype(F32)
    return w_D.astype(F32) * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


reference = rms_norm  # the kernel's oracle


def rms_norm_as(x_BD: jax.Array, w_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm(x; w, eps) in x's dtype: a block's normed input as the step stores it (and as the kernels that norm
    it in their prologue produce it: gemv_norm, router_topk's normed form)."""
    return rms_norm(x_BD, w_D, eps).astype(x_BD.dtype)


def gated_rms_norm(x_BHK: jax.Array, w_K: jax.Array, gate_BHK: jax.Array, eps: float) -> jax.Array:
    """FusedRMSNormGated(activation="sigmoid"): `RMSNorm(x) ⊙ sigmoid(gate)`, per head, fp32."""
    return rms_norm(x_BHK, w_K, eps) * jax.nn.sigmoid(gate_BHK.astype(F32))


def _kernel(x_ref, w_ref, o_ref, *, eps: float):
    x = x_ref[...].astype(F32)
    o_ref[...] = (w_ref[...].astype(F32) * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
                  ).astype(o_ref.dtype)


def rms_norm_pallas(x_BD: jax.Array, w_D: jax.Array, eps: float, interpret: bool = False) -> jax.Array:
    """The same function as the reference: fp32 [B, D] = w ⊙ x / sqrt(mean(x²) + eps)."""
    from jax.experimental import pallas as pl

    B, D = x_BD.shape
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps), out_shape=jax.ShapeDtypeStruct((B, D), F32), grid=(B,),
        in_specs=[pl.BlockSpec((1, D), lambda i: (i, 0)), pl.BlockSpec((D,), lambda i: (0,))],
        out_specs=pl.BlockSpec((1, D), lambda i: (i, 0)), interpret=interpret, name="rms_norm")(x_BD, w_D)


def fits(x_BD, w_D, eps, **_) -> str | None:
    if x_BD.ndim != 2 or w_D.shape != x_BD.shape[-1:]:
        return f"rms_norm kernel takes x [B, D] and w [D], got {x_BD.shape} and {w_D.shape}"
    D = x_BD.shape[-1]
    if D & (D - 1) or D > 16384:  # one block per row: Triton blocks are powers of two
        return f"rms_norm kernel needs D a power of two <= 16384, got {D}"
    return None


register(Kernel("rms_norm", reference, rms_norm_pallas, platforms=("gpu",), fits=fits,
                measured="1.04-1.06x XLA at D 512 (the MLA kv_a norm); the hidden sizes do not fit (H200, jax "
                         "0.11.2, 2026-12-01)"))
