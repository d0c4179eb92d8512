"""RMSNorm and gated RMSNorm (docs/SPEC.md §3.0, §3.2 output norm), computed in fp32.

`RMSNorm(x; w, eps) = w ⊙ x / sqrt(mean(x²) + eps)`: the weight multiplies directly (no 1+w).
Both return fp32; callers cast to the activation dtype where a value is stored.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def rms_norm(x_BD: jax.Array, w_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; x and w any float dtype, result fp32 of x's shape."""
    x = x_BD.astype(F32)
    return w_D.astype(F32) * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(x_BHK: jax.Array, w_K: jax.Array, gate_BHK: jax.Array, eps: float) -> jax.Array:
    """FusedRMSNormGated(activation="sigmoid"): `RMSNorm(x) ⊙ sigmoid(gate)`, per head, fp32."""
    return rms_norm(x_BHK, w_K, eps) * jax.nn.sigmoid(gate_BHK.astype(F32))
