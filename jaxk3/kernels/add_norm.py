"""The MoE block's input at decode, made in one kernel: the residual stream after the attention,
h = bf16(x + Σ_s parts[s]), then RMSNorm(h; w, eps) in x's dtype (docs/SPEC.md §3.0), from the stream before
the attention x [B, D] and the attention's o_proj output as its K splits' partial sums parts [S, B, D] fp32.

Why: at decode XLA makes this row in two kernels of its own before the router's logits (the sum of squares
in one CTA, then the scaling), each re-making h from x and the parts; the Kimi-Linear-48B step has 26 such
pairs.  Here one program a row does both: it loads the row's tiles once (the parts added in order, then x,
in fp32, as XLA adds `gemv.add_splits`' sum to the stream: the same bits of h), sums h² element-wise over
the tiles, reduces once, and writes w ⊙ h · rsqrt(mean(h²) + eps) in the reference's order.  Only the sum
of squares' order differs from XLA's, so the normed row agrees to one rounding of x's dtype at most (as
`gemv_norm`'s prologue).  XLA still makes h itself where it adds the MoE's output to the stream.

The switch `ADD_NORM` (off until timed on a GPU) lets `auto` take it; kernels="on" runs it wherever it fits.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels.gemv import add_splits
from jaxk3.kernels.registry import Kernel, pow2, register, triton_params
from jaxk3.kernels.rms_norm import rms_norm_as

F32 = jnp.float32
MAX_B = 8  # decode rows
MAX_S = 16  # partial sums

# Whether `auto` takes the kernel (the model then hands the attention's output to the MoE block as partial sums).
ADD_NORM = False
NUM_WARPS = 4
BK: int | None = None  # the tile (None: `tile(D)`); a power of two dividing D


def reference(x_BD: jax.Array, parts_SBD: jax.Array, w_D: jax.Array, eps: float, **_) -> jax.Array:
    """RMSNorm(bf16(x + Σ parts); w, eps) in x's dtype [B, D]: the stream's add as the model writes it
    (`attn_res.ffn_sources` on `gemv.add_splits(parts)`), then the block's input norm (`rms_norm_as`)."""
    h = (x_BD + add_splits(parts_SBD)).astype(x_BD.dtype)
    return rms_norm_as(h, w_D, eps)


def tile(D: int) -> int:
    """The widest power-of-two tile <= 1024 that divides D (0: none >= 16)."""
    return next((t for t in (1024, 512, 256, 128, 64, 32, 16) if D % t == 0), 0)


def _kernel(x_ref, p_ref, w_ref, o_ref, *, S: int, D: int, bk: int, eps: float):
    """Program b: row b.  Every tile's loads are written out (no loop): all of them are issued before the one
    cross-warp reduction."""
    from jax.experimental import pallas as pl

    b = pl.program_id(0)
    hs, acc = [], None
    for i in range(D // bk):
        cols = pl.ds(i * bk, bk)
        a = p_ref[0, b, cols]
        for s in range(1, S):
            a = a + p_ref[s, b, cols]
        h = (x_ref[b, cols].astype(F32) + a).astype(x_ref.dtype).astype(F32)
        hs.append(h)
        acc = h * h if acc is None else acc + h * h
    r = jax.lax.rsqrt(jnp.sum(acc) / D + eps)
    for i, h in enumerate(hs):
        cols = pl.ds(i * bk, bk)
        o_ref[b, cols] = ((w_ref[cols].astype(F32) * h) * r).astype(o_ref.dtype)


def add_rms_norm(x_BD: jax.Array, parts_SBD: jax.Array, w_D: jax.Array, eps: float, interpret: bool = False,
                 num_warps: int | None = None, only_where_faster: bool = True) -> jax.Array:
    """The same function as `reference`, one program a row: [B, D] in x's dtype."""
    from jax.experimental import pallas as pl

    B, D = x_BD.shape
    S = parts_SBD.shape[0]
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, S=S, D=D, bk=BK or tile(D), eps=float(eps)),
        grid=(B,), in_specs=[any_] * 3, out_specs=any_, out_shape=jax.ShapeDtypeStruct((B, D), x_BD.dtype),
        interpret=interpret, name="add_rms_norm", **triton_params(num_warps or NUM_WARPS, 1, interpret),
    )(x_BD, parts_SBD, w_D)


def fits(x_BD, parts_SBD, w_D, eps, only_where_faster: bool = True, **_) -> str | None:
    """Why this call does not suit the kernel (None: it does): x [B <= 8, D] bf16 or fp32, parts [S <= 16, B, D]
    fp32, w [D], D a multiple of 16; `auto` only with the switch on (`ADD_NORM`)."""
    if x_BD.ndim != 2 or parts_SBD.ndim != 3 or parts_SBD.shape[1:] != x_BD.shape or w_D.shape != x_BD.shape[1:]:
        return (f"add_rms_norm kernel takes x [B, D], parts [S, B, D] and w [D], got {x_BD.shape}, "
                f"{parts_SBD.shape}, {w_D.shape}")
    B, D = x_BD.shape
    S = parts_SBD.shape[0]
    if B > MAX_B or not 1 <= S <= MAX_S:
        return f"add_rms_norm kernel is for decode rows (B <= {MAX_B}) and 1..{MAX_S} parts, got B {B}, S {S}"
    if parts_SBD.dtype != F32 or x_BD.dtype not in (jnp.bfloat16, F32):
        return f"add_rms_norm kernel takes fp32 parts and a bf16 or fp32 stream, got {parts_SBD.dtype}, {x_BD.dtype}"
    if not tile(D) or not pow2(tile(D)):
        return f"add_rms_norm kernel needs D a multiple of 16 (its tiles), got {D}"
    if only_where_faster and not ADD_NORM:
        return "add_rms_norm kernel: not yet timed against XLA's two kernels (add_norm.ADD_NORM; kernels='on' runs it)"
    return None


register(Kernel("add_rms_norm", reference, add_rms_norm, platforms=("gpu",), fits=fits,
                measured="not measured (off: add_norm.ADD_NORM)"))
