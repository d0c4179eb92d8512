"""KDA's decode step and its output projection as one Pallas kernel at one token (`kda_decode_out`), beside its jnp
reference (`kda_decode_in`'s reference, then `gemv_gnorm`'s: what the layer computes without it).

Kimi-Linear's serving layout runs a KDA block at one token as three kernels: the input GEMV with the norm
(`gemv_norm`), the recurrent step (`kda_decode_in`, ~4 MB of state) and o_proj with the gated norm in its prologue
(`gemv_gnorm`, 18.9 MB).  Each kernel costs ~5 us beyond its bytes on an H200 (docs/PERF.md, thirty-eighth session:
scripts/gpu/read_floor.py), so the last two as one kernel save about one kernel's fixed cost per block.

The grid is `kda_decode_in`'s at one row, (head h, block j of `Config.bv` value columns): each program does the
head's conv and SiLU, l2 norms and gate, the gated delta rule on its [Kd, bv] columns of the float32 state (updated
in place: no other program reads them), writes its o (un-normed), and multiplies its gated, weighted columns
norm_w · o · sigmoid(z) by o_proj's bv columns of every row (`Config.bn` rows a loop step), one float32 partial per
(program, row).  The gated RMSNorm's 1/rms spans the head's Kd values, which no one program sees, but it is one scalar
per head: the wrapper computes it from o (XLA, [H, Kd]) and scales the head's summed partials by it, in the fusion that
adds the H·Kd/bv partials.

The form of the thirty-eighth session (a grid of (head, part of o_proj's rows), each program computing the head's
whole step and norm and writing the state into a new buffer) lost in the step on an H100 (2026-12-07, docs/PERF.md:
XLA copied the new state back into the cache, 20 kernels more).

Numerics: the step is `kda_decode_in`'s (the same tiles, so the same sums); the norm's sum of squares is XLA's over the
kernel's o; o_proj's products run in float32 in another order.  The one departure from the reference: it rounds each
normed element to the activation dtype before o_proj (bf16, a relative 2^-8 at most), this kernel does not (the scale
comes after the sum), so a row differs by at most 2^-8 of sum_c |w_nc · xn_c| plus float32 reassociation
(tests/test_kernels.py, `_out_bound`).  One token, the conv cache as the ring (`kda_decode.RING`).  Unproven until its
compiled tests and a step A/B have run on a GPU: neither `auto` nor the layer with kernels="on" takes it before then.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels.gemv import gnorm_reference
from jaxk3.kernels.kda_decode import conv_silu, delta_tile, fused_fits, fused_reference, log_gate, qk_l2norm, ring_slot
from jaxk3.kernels.registry import Kernel, pow2, register, triton_params

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    bv: int = 32  # value columns of the state per program (a power of two dividing the head dim)
    bn: int = 128  # o_proj rows per tile of the program's loop (a power of two dividing N)
    num_warps: int = 4
    num_stages: int = 3


# (local channels C, heads H, low rank d, o_proj rows N, activation dtype) where the step was measured faster with
# the kernel: `auto` takes it only there (none yet).
OUT_MEASURED: set[tuple[int, int, int, int, jnp.dtype]] = set()


def _kernel(y_ref, gb_ref, conv_ref, cw_ref, dtb_ref, alog_ref, on_ref, s_ref, valid_ref, pos_ref, w_ref,
            p_ref, o_ref, conv_out_ref, s_out_ref, *, C: int, H: int, d: int, Kd: int, W: int, bv: int, bn: int,
            N: int, lb: float | None):
    """Program (h, j): head h's step on its state columns [j·bv, (j+1)·bv) in place (kda_decode_in's program), its
    o there (un-normed, for the wrapper's sum of squares) and o_proj's partial over those bv columns of every row,
    the columns gated and weighted but not yet scaled by the head's 1/rms."""
    from jax.experimental import pallas as pl

    h, j = pl.program_id(0), pl.program_id(1)
    cdt = conv_out_ref.dtype  # the step's casts, as kda_decode_in's (the cache's dtype)
    h0 = h * Kd
    ch = pl.ds(h0, Kd)  # the head's q/k channels
    c0 = h0 + j * bv
    cv = pl.ds(c0, bv)  # this program's value channels
    vs = pl.ds(j * bv, bv)  # its columns of the state
    pos = pos_ref[0]
    n_old = W - 1  # the ring's cached taps

    def slot(t):  # slot(n_old) takes this token
        return ring_slot(pos, t, W)

    def U(i, chans):  # the raw projection of q (0), k (1) or v (2) at `chans`
        return y_ref[0, pl.ds(i * C + chans.start, chans.size)].astype(cdt)

    def conv(i, chans):
        return conv_silu(U(i, chans).astype(F32), conv_ref, cw_ref, 0, i, chans, n_old, slot)

    q, k = qk_l2norm(conv(0, ch), conv(1, ch), Kd)
    v = conv(2, cv)
    fa = y_ref[0, pl.ds(3 * C, d)].astype(cdt).astype(F32)
    f = jnp.sum(gb_ref[0, ch, :].astype(F32) * fa[None, :], axis=1) + dtb_ref[ch]
    ga = y_ref[0, pl.ds(3 * C + d + H, d)].astype(cdt).astype(F32)
    z = jnp.sum(gb_ref[1, cv, :].astype(F32) * ga[None, :], axis=1)
    beta = jax.nn.sigmoid(y_ref[0, 3 * C + d + h])
    S0 = s_ref[0, h, :, vs]
    S, o = delta_tile(S0, jnp.exp(log_gate(jnp.exp(alog_ref[h]), f, lb)), k, q, v, beta)
    keep = valid_ref[0] != 0
    s_out_ref[0, h, :, vs] = jnp.where(keep, S, S0)  # in place: no other program reads these columns
    o_ref[0, cv] = o
    for i, chans, own in ((0, ch, j == 0), (1, ch, j == 0), (2, cv, True)):  # this token's ring slot, in place
        @pl.when(own & keep)
        def _():
            conv_out_ref[0, i, chans, slot(n_old)] = U(i, chans)

    # the gated, weighted columns before the head's 1/rms (a scalar of the head: the wrapper applies it to the sum)
    x = on_ref[vs] * o * jax.nn.sigmoid(z)
    p = h * (Kd // bv) + j

    def body(i, carry):  # o_proj's rows bn at a time, this program's bv columns summed per row
        rw = pl.ds(pl.multiple_of(i * bn, bn), bn)
        p_ref[p, rw] = jnp.sum(w_ref[rw, cv].astype(F32) * x[None, :], axis=1)
        return carry
    jax.lax.fori_loop(0, N // bn, body, 0)


def kda_decode_out(cfg, y_BX, gate_b_2Cd, conv_B3CW, cw, state_BHKV, valid_B, w_o, dt, interpret: bool = False,
                   config: Config | None = None, only_where_faster: bool = True, pos_B: jax.Array | None = None):
    """`reference`'s function, its normed elements not rounded to `dt` before o_proj: (out fp32 [1, N] =
    o_proj(gated norm(the step's o)), new conv, new state).  `w_o` [N, C] is this rank's o_proj (row-parallel: the
    caller sums the ranks' outputs).  The state and the ring are updated in place."""
    from jax.experimental import pallas as pl

    c = config or Config()
    C, d = gate_b_2Cd.shape[1], gate_b_2Cd.shape[2]
    H, Kd = state_BHKV.shape[1], cfg.kda_head_dim
    N = w_o.shape[0]
    W = conv_B3CW.shape[-1]
    bv = min(c.bv, Kd)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, C=C, H=H, d=d, Kd=Kd, W=W, bv=bv, bn=c.bn, N=N, lb=cfg.gate_lower_bound)
    p, o, conv, state = pl.pallas_call(
        kernel, grid=(H, Kd // bv), in_specs=[any_] * 11, out_specs=[any_] * 4,
        out_shape=(jax.ShapeDtypeStruct((H * (Kd // bv), N), F32), jax.ShapeDtypeStruct((1, C), F32),
                   jax.ShapeDtypeStruct(conv_B3CW.shape, conv_B3CW.dtype),
                   jax.ShapeDtypeStruct(state_BHKV.shape, F32)),
        input_output_aliases={2: 2, 7: 3}, interpret=interpret, name="kda_step_out",
        **triton_params(c.num_warps, c.num_stages, interpret),
    )(y_BX.astype(F32), gate_b_2Cd, conv_B3CW, cw.conv_3CK, cw.dt_bias_C.astype(F32), cw.A_log_H.astype(F32),
      cw.o_norm_K.astype(F32), state_BHKV, valid_B.astype(jnp.int32), pos_B.astype(jnp.int32), w_o)
    # each head's 1/rms over its Kd values (gemv_gnorm's eps and mean), applied to the head's summed partials
    o_HK = o.reshape(H, Kd)
    r_H = jax.lax.rsqrt(jnp.sum(o_HK * o_HK, axis=1) / Kd + float(cfg.rms_norm_eps))
    out = jnp.einsum("hn,h->n", jnp.sum(p.reshape(H, Kd // bv, N), axis=1), r_H)
    return out[None], conv, state


def reference(cfg, y_BX, gate_b_2Cd, conv_B3CW, cw, state_BHKV, valid_B, w_o, dt, config: Config | None = None,
              only_where_faster: bool = True, pos_B: jax.Array | None = None):
    """What the layer computes without the kernel: `kda_decode_in`'s reference leaving o un-normed, then o_proj with
    the gated norm (`gemv_gnorm`'s reference): (out fp32 [B, N], new conv, new state)."""
    o, z, conv, state = fused_reference(cfg, y_BX, gate_b_2Cd, conv_B3CW, cw, state_BHKV, valid_B, gated=False,
                                        pos_B=pos_B)
    return gnorm_reference(o, z, cw.o_norm_K, cfg.rms_norm_eps, w_o, dt), conv, state


def fits(cfg, y_BX, gate_b_2Cd, conv_B3CW, cw, state_BHKV, valid_B, w_o, dt, config: Config | None = None,
         only_where_faster: bool = True, pos_B: jax.Array | None = None, **_) -> str | None:
    """Why this call does not suit `kda_decode_out` (None: it does): `kda_decode_in`'s inputs at one row with the
    ring conv cache, bf16 o_proj [N, C] over the local channels, tiles dividing the shapes; `auto` only where the
    step was measured faster with it (`OUT_MEASURED`), kernels="on" wherever it fits."""
    if y_BX.ndim != 2 or y_BX.shape[0] != 1:
        return f"kda_decode_out kernel takes one token (in_proj's output [1, X]), got {y_BX.shape}"
    if pos_B is None:
        return "kda_decode_out kernel needs the conv cache as the ring (kda_decode.RING) and the rows' positions"
    why = fused_fits(cfg, y_BX, gate_b_2Cd, conv_B3CW, cw, state_BHKV, valid_B, only_where_faster=False,
                     pos_B=pos_B)
    if why:
        return why.replace("kda_decode_in kernel", "kda_decode_out kernel")
    C, d, H, Kd = gate_b_2Cd.shape[1], gate_b_2Cd.shape[2], state_BHKV.shape[1], cfg.kda_head_dim
    if w_o.ndim != 2 or w_o.shape[1] != C or w_o.dtype != jnp.bfloat16:
        return f"kda_decode_out kernel: o_proj must be bf16 [N, C] with C = {C} local channels, got {w_o.dtype} {w_o.shape}"
    if cw.o_norm_K.shape != (Kd,) or state_BHKV.shape[0] != 1 or conv_B3CW.shape[0] != 1:
        return (f"kda_decode_out kernel: one row of state and conv cache and the norm weight [{Kd}], got state "
                f"{state_BHKV.shape}, conv {conv_B3CW.shape}, norm {cw.o_norm_K.shape}")
    c = config or Config()
    N = w_o.shape[0]
    if not (pow2(c.bv) and pow2(c.bn)) or Kd % min(c.bv, Kd) or N % c.bn:
        return (f"kda_decode_out kernel: bv {c.bv} and bn {c.bn} must be powers of two, bv dividing the head dim {Kd} "
                f"and bn o_proj's {N} rows")
    if only_where_faster and (C, H, d, N, jnp.dtype(dt)) not in OUT_MEASURED:
        return (f"kda_decode_out kernel: auto takes it where the step was measured faster with it ((C, H, d, N, dtype) "
                f"in {sorted(map(str, OUT_MEASURED))}), got {(C, H, d, N, str(jnp.dtype(dt)))}")
    return None


register(Kernel("kda_decode_out", reference, kda_decode_out, platforms=("gpu",), fits=fits,
                unproven="built in the thirty-eighth session; its compiled tests not yet run on a GPU",
                measured="not measured"))
