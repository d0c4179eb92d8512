"""Helpers shared by the blocks: the tensor-parallel context, the GEMV, the psum, the GLU activations."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxk3 import collectives, kernels
from jaxk3.kernels import gemv
from jaxk3.kernels.rms_norm import rms_norm_as

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


@dataclasses.dataclass(frozen=True)
class Normed:
    """A block's input RMSNorm(h; w, eps) in h's dtype, not yet computed (a trace-time value): the decode
    step hands it to the block instead of the normed array, so that the GEMVs that read it can norm h in
    their prologue (the `gemv_norm` kernel, where auto takes it) rather than XLA in two kernels of its own
    before them (the MoE block's router has such a form too, not taken: jaxk3.kernels.router).  `value()`
    is the normed array (what every other reader gets; XLA computes it once however many readers ask)."""
    h: jax.Array  # [B, D] the residual stream
    w: jax.Array  # [D] the norm weight
    eps: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.h.shape

    @property
    def dtype(self):
        return self.h.dtype

    @property
    def ndim(self) -> int:
        return self.h.ndim

    def value(self) -> jax.Array:
        return rms_norm_as(self.h, self.w, self.eps)


def value(x: jax.Array | Normed) -> jax.Array:
    """The array itself, or a `Normed` input computed."""
    return x.value() if isinstance(x, Normed) else x


def linear(x_BD: jax.Array | Normed, w_FD: jax.Array, tp: TP | str | None = None, sums: bool = False) -> jax.Array:
    """`x @ w.T` for a weight `w [out, in]` (the checkpoint's and the serving layout's), inputs in w's
    dtype, fp32 accumulate/out: the `gemv` kernel where the kernel mode of `tp` and the shape allow
    (decode rows, bf16 weights, a shape where it beat XLA's dot: jaxk3.kernels.gemv), else XLA's dot.
    A `Normed` input is normed in the kernel's prologue (`gemv_norm`) where that kernel runs, else
    computed first.  `sums` (a [B, D] input): the kernel's partial sums over its K splits [S, B, F]
    (their sum is the product; XLA's dot: S = 1) for a consumer that adds them as it reads them, where a
    custom call would otherwise wait for an XLA kernel adding them."""
    if isinstance(x_BD, Normed):
        mode = kernel_mode(tp)
        args = (x_BD.h, w_FD)
        kw = dict(norm_w=x_BD.w, eps=x_BD.eps)
        if x_BD.h.ndim == 2 and kernels.explain("gemv_norm", *args, mode=mode, **kw).startswith("device"):
            return kernels.call("gemv_norm", *args, mode=mode, sums=sums, **kw)
        x_BD = x_BD.value()
    if x_BD.ndim != 2:
        y = jnp.einsum("...d,fd->...f", x_BD.astype(w_FD.dtype), w_FD, preferred_element_type=F32)
        return y[None] if sums else y
    mode = kernel_mode(tp)
    if mode == "on" and (x_BD.shape[0] > gemv.MAX_B or w_FD.dtype != jnp.bfloat16):
        mode = "auto"  # the kernel is for decode rows of bf16 weights: prefill and fp32 models keep XLA's dot
    return kernels.call("gemv", x_BD, w_FD, mode=mode, sums=sums)


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
