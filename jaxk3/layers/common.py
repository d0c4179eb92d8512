"""Helpers shared by the blocks: the tensor-parallel context, the GEMV, the psum, the GLU activations."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxk3 import collectives

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
    return collectives.psum(x, tp.axis, impl=tp.psum)


#END
