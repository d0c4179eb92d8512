"""Helpers shared by the blocks: the tensor-parallel context, the GEMV, the psum, the GLU activations."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TP:
    """The tensor-parallel mesh axis a block runs over, which collective implementations it uses
    (`"auto" | "ffi" | "lax"`, see jaxk3.collectives), and the device-kernel mode (`"auto" | "off" |
    "on"`, see jaxk3.kernels).  Blocks take `tp: TP | str | None`: a bare axis name means the
    defaults below; None means one device (no collectives, kernels "auto")."""
    axis: str
    gather: str = "auto"
    psum: str = "auto"
    kernels: str = "auto"


def kernel_mode(tp: TP | str | None) -> str:
    tp = as_tp(tp)
    return "auto" if tp is None else tp.kernels


def as_tp(tp: TP | str | None) -> TP | None:
    return TP(tp) if isinstance(tp, str) else tp


def linear(x_BD: jax.Array, w_FD: jax.Array) -> jax.Array:
    """`x @ w.T` for a checkpoint weight `w [out, in]`, inputs in w's dtype, fp32 accumulate/out."""
    return jnp.einsum("bd,fd->bf", x_BD.astype(w_FD.dtype), w_FD, preferred_element_type=F32)


def psum(x: jax.Array, tp: TP | str | None) -> jax.Array:
    """Sum the row-parallel partials over the TP axis (identity without one)."""
    tp = as_tp(tp)
    if tp is None:
        return x
    if tp.psum == "lax":
        return lax.psum(x, tp.axis)
    from jaxk3 import collectives

    return collectives.psum(x, tp.axis, impl=tp.psum)


def glu(a: jax.Array, b: jax.Array, act: str, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    """Gated activation in fp32: SiLU-GLU `silu(a)*b`, or SiTU-GLU (docs/SPEC.md §3.5):
    `β1·tanh(a/β1)·sigmoid(a) · β2·tanh(b/β2)`."""
    a, b = a.astype(F32), b.astype(F32)
    if act == "silu":
        return jax.nn.silu(a) * b
    if act == "situ":
        return beta * jnp.tanh(a / beta) * jax.nn.sigmoid(a) * (linear_beta * jnp.tanh(b / linear_beta))
    raise ValueError(f"hidden_act: unknown activation {act!r}")
