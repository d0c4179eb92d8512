"""The MoE block's input at decode (Kimi-Linear: a plain residual, no AttnRes) as one Pallas kernel (`moe_in`), beside
its jnp reference `reference` (the MoE block's own math: jaxk3.layers.moe calls it either way).

What it computes, per row b, from the residual p before the attention block's output was added and that output as
partial sums a [S, B, D] (a GEMV's sums over its K splits, jaxk3.kernels.gemv `sums=True`; S = 1 for a summed one):

    h[b]       = (p[b] + Σ_s a[s, b]) in p's dtype       (the residual after attention; the sum over s in order)
    xn[b]      = RMSNorm(h[b]; norm_w, eps) in p's dtype  (the experts' input)
    logits[b]  = xn[b] · gate^T in float32               (the router's logits [E]; bf16 products are exact in fp32)

XLA runs this part of the 48B step as four small kernels per MoE layer (the add of o_proj's partial sums to the
residual 1.3-1.7 us, the norm's sum of squares 1.2, its scaling 1.2, the router's dot 1.7: the census of the ninth
session, docs/PERF.md).  Here the grid is (row, block of `Config.be` experts): every program loads its row's p, a and
the norm weight and its [be, D] rows of the router's weight all at once (the row is a few KB; the loops are written
out in Config.chunk-wide parts because Triton blocks are powers of two and D = 2304 is not), forms h and its norm,
and writes its be logits; program (b, 0) also writes xn.  h itself is not written: the fusion of XLA's that adds the
MoE's output to the residual recomputes it from p and a (element-wise, inside that fusion: no kernel of its own).

The sums run in another order than XLA's (the norm's mean, the logits' dot), so xn agrees to one rounding of p's dtype
and the logits to float32 rounding of the sum (tests/test_kernels.py); h's sum over s is in the reference's order.

The three earlier folds of the MoE input norm (the router kernel norming, the experts' kernel 1 norming, the router's
normed GEMV writing the row: fourth and seventh sessions) left XLA's residual add in place and either chained a K loop
in few programs or made every experts' program norm the row; this one replaces the add too and loads everything in
one round trip.  Unmeasured until its step A/B: `auto` takes it only where the step was measured faster (`MEASURED`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels.gemv import add_splits
from jaxk3.kernels.registry import Kernel, pow2, register, triton_params
from jaxk3.kernels.rms_norm import rms_norm_as

F32 = jnp.float32
MAX_B = 8  # decode rows


@dataclasses.dataclass(frozen=True)
class Config:
    be: int = 8  # router rows (experts) per program: a power of two dividing E
    chunk: int = 256  # columns per part of the written-out loops: a power of two dividing D
    num_warps: int = 4


def residual(p_BD: jax.Array, a_SBD: jax.Array | None) -> jax.Array:
    """h = p + Σ_s a[s] in p's dtype: the residual after the attention block (jaxk3.layers.attn_res's `ffn_sources`
    with the attention's output as its partial sums); p itself where a is None (XLA added them)."""
    return p_BD if a_SBD is None else (p_BD + add_splits(a_SBD)).astype(p_BD.dtype)


def reference(p_BD: jax.Array, a_SBD: jax.Array | None, norm_w_D: jax.Array, gate_ED: jax.Array, eps: float,
              config: Config | None = None, **_) -> tuple[jax.Array, jax.Array]:
    """(xn [B, D] in p's dtype, logits [B, E] fp32): RMSNorm of the residual after attention, and the router's logits
    of it (jaxk3.layers.moe.router_logits' arithmetic)."""
    xn = rms_norm_as(residual(p_BD, a_SBD), norm_w_D, eps)
    return xn, jnp.einsum("bd,ed->be", xn.astype(F32), gate_ED.astype(F32))


def _kernel(*refs, S: int, D: int, chunk: int, be: int, eps: float):
    """Program (b, j): row b, experts [j·be, (j+1)·be).  S = 0: no partial sums (p is the residual)."""
    from jax.experimental import pallas as pl

    p_ref, a_ref, g_ref, w_ref, xn_ref, lg_ref = refs if S else (refs[0], None, *refs[1:])
    b, j = pl.program_id(0), pl.program_id(1)
    parts = [pl.ds(c * chunk, chunk) for c in range(D // chunk)]
    hs, sq = [], None
    for cols in parts:  # h = (p + a_0 + ... + a_{S-1}) rounded to p's dtype, and Σ h² element-wise
        h = p_ref[b, cols].astype(F32)
        if S:
            s = a_ref[0, b, cols]
            for t in range(1, S):
                s = s + a_ref[t, b, cols]
            h = (h + s).astype(p_ref.dtype).astype(F32)
        hs.append(h)
        sq = h * h if sq is None else sq + h * h
    r = jax.lax.rsqrt(jnp.sum(sq) / D + eps)
    rows = pl.ds(pl.multiple_of(j * be, be), be)
    acc = None
    for cols, h in zip(parts, hs):
        xn = ((g_ref[cols].astype(F32) * h) * r).astype(xn_ref.dtype)  # rms_norm's order: (w ⊙ x) · rsqrt(...)

        @pl.when(j == 0)
        def _():
            xn_ref[b, cols] = xn
        t = w_ref[rows, cols].astype(F32) * xn.astype(F32)[None, :]  # [be, chunk]
        acc = t if acc is None else acc + t
    lg_ref[b, rows] = jnp.sum(acc, axis=1)


def moe_in(p_BD: jax.Array, a_SBD: jax.Array | None, norm_w_D: jax.Array, gate_ED: jax.Array, eps: float,
           config: Config | None = None, interpret: bool = False, **_) -> tuple[jax.Array, jax.Array]:
    """The same function as `reference`, one kernel."""
    from jax.experimental import pallas as pl

    c = config or Config()
    B, D = p_BD.shape
    E = gate_ED.shape[0]
    be = min(c.be, E)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    args = (p_BD, norm_w_D, gate_ED) if a_SBD is None else (p_BD, a_SBD.astype(F32), norm_w_D, gate_ED)
    return tuple(pl.pallas_call(
        functools.partial(_kernel, S=0 if a_SBD is None else a_SBD.shape[0], D=D, chunk=c.chunk, be=be,
                          eps=float(eps)),
        grid=(B, E // be), in_specs=[any_] * len(args), out_specs=[any_] * 2,
        out_shape=(jax.ShapeDtypeStruct((B, D), p_BD.dtype), jax.ShapeDtypeStruct((B, E), F32)),
        interpret=interpret, **triton_params(c.num_warps, 1, interpret),
    )(*args))


# Whether the decode step hands the MoE block the attention's output as partial sums with the residual before it
# (`Normed.add`, so that this kernel also does XLA's add of the two), or the residual after it (XLA's add kept: its
# fusion also rounds h once for both readers).  Measured (tenth session, call 1): with the partials the kernel took
# 6.6-6.9 us a MoE layer in 8 programs (each loading o_proj's four partial rows, 37 KB, besides its [8, D] router rows)
# and the final residual add 0.6 us more (it recomputes h from them): the 48B step 55 us slower.
PARTIALS = True

# (B, E, D) where the 48B step was measured faster with this kernel on an H200; auto takes it only there.  Empty until
# its step A/B (scripts/gpu/ab_call.sh with AB="moe_in@1"; kernels="on" and step_with_kernel.py run it anywhere).
MEASURED: set[tuple[int, int, int]] = set()


def fits(p_BD, a_SBD, norm_w_D, gate_ED, eps, config: Config | None = None, only_where_faster: bool = True,
         **_) -> str | None:
    """Why this call does not suit the kernel (None: it does)."""
    c = config or Config()
    if p_BD.ndim != 2 or (a_SBD is not None and (a_SBD.ndim != 3 or a_SBD.shape[1:] != p_BD.shape)):
        return (f"moe_in kernel takes the residual p [B, D] and the attention's partial sums a [S, B, D], got "
                f"{p_BD.shape} and {getattr(a_SBD, 'shape', None)}")
    B, D = p_BD.shape
    if B > MAX_B:
        return f"moe_in kernel is for decode rows (B <= {MAX_B}), got B = {B}"
    if gate_ED.ndim != 2 or gate_ED.shape[1] != D or norm_w_D.shape != (D,):
        return (f"moe_in kernel: the router's weight must be [E, {D}] and the norm weight [{D}], got "
                f"{gate_ED.shape} and {norm_w_D.shape}")
    E = gate_ED.shape[0]
    if not (pow2(c.chunk) and c.chunk >= 16 and D % c.chunk == 0):
        return f"moe_in kernel: D = {D} in parts of Config.chunk {c.chunk} (a power of two >= 16 dividing D)"
    if not (pow2(min(c.be, E)) and E % min(c.be, E) == 0):
        return f"moe_in kernel: {E} experts in blocks of Config.be {c.be} (a power of two dividing E)"
    if only_where_faster and (B, E, D) not in MEASURED:
        return (f"moe_in kernel: the step at (B, E, D) = {(B, E, D)} was not measured with it on an H200 "
                "(kernels='on' runs it)")
    return None


register(Kernel("moe_in", reference, moe_in, platforms=("gpu",), fits=fits,
                measured="not measured"))  # in the step: the 48B at B = 1 55 us slower with PARTIALS (tenth session)
