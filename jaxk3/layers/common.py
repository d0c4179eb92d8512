"""Helpers shared by the blocks: the tensor-parallel context, the GEMV, the psum, the GLU activations."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxk3 import collectives, kernels
from jaxk3.kernels import gemv

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


def linear(x_BD: jax.Array, w_FD: jax.Array, tp: TP | str | None = None) -> jax.Array:
    """`x @ w.T` for a weight `w [out, in]` (the checkpoint's and the serving layout's), inputs in w's
    dtype, fp32 accumulate/out: the `gemv` kernel where the kernel mode of `tp` and the shape allow
    (decode rows, bf16 weights, a shape where it beat XLA's dot: jaxk3.kernels.gemv), else XLA's dot."""
    if x_BD.ndim != 2:
        return jnp.einsum("...d,fd->...f", x_BD.astype(w_FD.dtype), w_FD, preferred_element_type=F32)
    mode = kernel_mode(tp)
    if mode == "on" and (x_BD.shape[0] > gemv.MAX_B or w_FD.dtype != jnp.bfloat16):
        mode = "auto"  # the kernel is for decode rows of bf16 weights: prefill and fp32 models keep XLA's dot
    return kernels.call("gemv", x_BD, w_FD, mode=mode)


def split(y_NX: jax.Array, widths) -> list[jax.Array]:
    """The columns of a fused projection's output, one part per member (`widths` in member order)."""
    out, off = [], 0
    for n in widths:
        out.append(y_NX[..., off:off + n])
        off += n
    if off != y_NX.shape[-1]:
        raise ValueError(f"split: parts {list(widths)} add up to {off}, the fused output has {y_NX.shape[-1]}")
    return out


def psum(x: jax.Array, tp: TP | str | None) -> jax.Array:
    """Sum the row-parallel partials over the TP axis (identity without one)."""
    tp = as_tp(tp)
    if tp is None:
        return x
    if tp.psum == "lax":
        return lax.psum(x, tp.axis)
    return collectives.psum(x, tp.axis, impl=tp.psum)


#END
