"""KDA's decode step and its output projection as one Pallas kernel at one token (`kda_decode_out`), beside its jnp
reference (`kda_decode_in`'s reference, then `gemv_gnorm`'s: what the layer computes without it).

Kimi-Linear's serving layout runs a KDA block at one token as three kernels: the input GEMV with the norm
(`gemv_norm`), the recurrent step (`kda_decode_in`, ~4 MB of state in 6.8 us on an H200) and o_proj with the gated
norm in its prologue (`gemv_gnorm`, 18.9 MB in 8.3 us).  A read-only kernel of o_proj's size spends ~6 us beyond its
bytes on an H200 (docs/PERF.md, thirty-eighth session: scripts/gpu/read_floor.py), so the last two as one kernel
would save about one kernel's fixed cost per block.

The grid is (head h, part r): every program of head h computes the head's whole step (the conv and SiLU of its q, k
and v channels, the l2 norms, the gate, the gated delta rule over the head's [Kd, Kd] float32 state in tiles of
`Config.bv` value columns) and its gated RMSNorm (which spans the head's Kd values, so a program must see them all),
then multiplies the normed head by its part of o_proj's columns of that head: rows [r·N/P, (r+1)·N/P) of
W_o[:, h·Kd:(h+1)·Kd], in tiles of `Config.bn` rows, one float32 partial per (head, row).  XLA adds the H partials in
the fusion that consumes the output (the residual add), as it adds a split GEMV's.  The P programs of a head read its
state P times (P x 2 MB for the 48B's 32 heads) and write it once between them into a new buffer (program r the
tiles j with j mod P = r; in place, a program could read a tile another had already written), program 0 this token's
conv slot in place (the ring: no program reads it), so the parts trade state reads for programs.

The arithmetic is the reference's: the step as `kda_decode_in` computes it (the same tiles, so the same sums), the
norm as `gemv_gnorm`'s prologue (its mean over the head summed tile by tile), the product in float32 with the head's
columns summed per row and the heads by XLA: o_proj's sums run in another order than XLA's dot, and a normed element
whose float32 value moved by that order can round to the other bf16 neighbour, so the output agrees to float32
reassociation and such flips (tests/test_kernels.py, OUT_TOL).  One token, the conv cache as the ring
(`kda_decode.RING`).  Unproven until its first GPU call (scripts/gpu/s38_call6.sh): neither `auto` nor the layer with
kernels="on" takes it before then.
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
    parts: int = 4  # programs per head, each its share of o_proj's rows (a power of two dividing N / bn)
    bv: int = 32  # value columns of the state per tile (a power of two dividing the head dim)
    bn: int = 32  # o_proj rows per tile (a power of two)
    num_warps: int = 4
    num_stages: int = 3


# (local channels C, heads H, low rank d, o_proj rows N, activation dtype) where the step was measured faster with
# the kernel: `auto` takes it only there (none yet: built in the thirty-eighth session, timed by its first GPU call).
OUT_MEASURED: set[tuple[int, int, int, int, jnp.dtype]] = set()


def _kernel(y_ref, gb_ref, conv_ref, cw_ref, dtb_ref, alog_ref, on_ref, s_ref, valid_ref, pos_ref, w_ref,
            out_ref, conv_out_ref, s_out_ref, *, C: int, H: int, d: int, Kd: int, W: int, bv: int, bn: int,
            rows: int, parts: int, lb: float | None, eps: float, dt):
    """Program (h, r): head h's step, its norm, and rows [r·rows, (r+1)·rows) of its o_proj partial."""
    from jax.experimental import pallas as pl

    h, r = pl.program_id(0), pl.program_id(1)
    cdt = conv_out_ref.dtype  # the step's casts, as kda_decode_in's (the cache's dtype); `dt` is the norm's
    h0 = h * Kd
    ch = pl.ds(h0, Kd)
    pos = pos_ref[0]
    n_old = W - 1  # the ring's cached taps

    def slot(t):  # slot(n_old) takes this token
        return ring_slot(pos, t, W)

    def U(i, start, size):  # the raw projection of q (0), k (1) or v (2) at channels [start, start + size)
        return y_ref[0, pl.ds(i * C + start, size)].astype(cdt)

    def conv(i, start, size):
        return conv_silu(U(i, start, size).astype(F32), conv_ref, cw_ref, 0, i, pl.ds(start, size), n_old, slot)

    q, k = qk_l2norm(conv(0, h0, Kd), conv(1, h0, Kd), Kd)
    fa = y_ref[0, pl.ds(3 * C, d)].astype(cdt).astype(F32)
    f = jnp.sum(gb_ref[0, ch, :].astype(F32) * fa[None, :], axis=1) + dtb_ref[ch]
    ga = y_ref[0, pl.ds(3 * C + d + H, d)].astype(cdt).astype(F32)
    beta = jax.nn.sigmoid(y_ref[0, 3 * C + d + h])
    decay = jnp.exp(log_gate(jnp.exp(alog_ref[h]), f, lb))
    keep = valid_ref[0] != 0

    os_, zs = [], []
    for j in range(Kd // bv):  # the head's state in tiles of bv value columns, as kda_decode_in's programs walk it
        c0 = h0 + j * bv
        vs = pl.ds(j * bv, bv)
        v = conv(2, c0, bv)
        zs.append(jnp.sum(gb_ref[1, pl.ds(c0, bv), :].astype(F32) * ga[None, :], axis=1))
        S0 = s_ref[0, h, :, vs]
        S, o = delta_tile(S0, decay, k, q, v, beta)  # [Kd, bv], [bv]
        os_.append(o)

        @pl.when(r == j % parts)  # one program writes each tile, into a new buffer: every program of the head reads
        def _():                  # every tile, so the state is not updated in place
            s_out_ref[0, h, :, vs] = jnp.where(keep, S, S0)

    @pl.when(keep & (r == 0))  # this token's conv slot (which no program of this step reads), in place
    def _():
        s_new = slot(n_old)
        for i in range(3):
            conv_out_ref[0, i, ch, s_new] = U(i, h0, Kd)

    # the gated RMSNorm over the head's Kd values, as gemv_gnorm's prologue computes it, in the activation dtype
    ss = os_[0] * os_[0]
    for o in os_[1:]:
        ss = ss + o * o
    rr = jax.lax.rsqrt(jnp.sum(ss) / Kd + eps)
    xs = [((on_ref[pl.ds(j * bv, bv)] * o) * rr * jax.nn.sigmoid(z)).astype(dt).astype(w_ref.dtype).astype(F32)
          for j, (o, z) in enumerate(zip(os_, zs))]

    def body(i, carry):  # o_proj's rows of this part, bn at a time: the head's Kd columns summed per row
        rw = pl.ds(pl.multiple_of(r * rows + i * bn, bn), bn)
        acc = None
        for j, x in enumerate(xs):
            t = w_ref[rw, pl.ds(pl.multiple_of(h0 + j * bv, bv), bv)].astype(F32) * x[None, :]
            acc = t if acc is None else acc + t
        out_ref[h, rw] = jnp.sum(acc, axis=1)
        return carry
    jax.lax.fori_loop(0, rows // bn, body, 0)


def kda_decode_out(cfg, y_BX, gate_b_2Cd, conv_B3CW, cw, state_BHKV, valid_B, w_o, dt, interpret: bool = False,
                   config: Config | None = None, only_where_faster: bool = True, pos_B: jax.Array | None = None):
    """The same function as `reference`: (out fp32 [1, N] = o_proj(gated norm(the step's o)), new conv, new state).
    `w_o` [N, C] is this rank's o_proj (row-parallel: the caller sums the ranks' outputs)."""
    from jax.experimental import pallas as pl

    c = config or Config()
    C, d = gate_b_2Cd.shape[1], gate_b_2Cd.shape[2]
    H, Kd = state_BHKV.shape[1], cfg.kda_head_dim
    N = w_o.shape[0]
    W = conv_B3CW.shape[-1]
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, C=C, H=H, d=d, Kd=Kd, W=W, bv=min(c.bv, Kd), bn=c.bn, rows=N // c.parts,
                               parts=c.parts, lb=cfg.gate_lower_bound, eps=float(cfg.rms_norm_eps), dt=jnp.dtype(dt))
    p, conv, state = pl.pallas_call(
        kernel, grid=(H, c.parts), in_specs=[any_] * 11, out_specs=[any_] * 3,
        out_shape=(jax.ShapeDtypeStruct((H, N), F32), jax.ShapeDtypeStruct(conv_B3CW.shape, conv_B3CW.dtype),
                   jax.ShapeDtypeStruct(state_BHKV.shape, F32)),
        input_output_aliases={2: 1}, interpret=interpret, name="kda_step_out",
        **triton_params(c.num_warps, c.num_stages, interpret),
    )(y_BX.astype(F32), gate_b_2Cd, conv_B3CW, cw.conv_3CK, cw.dt_bias_C.astype(F32), cw.A_log_H.astype(F32),
      cw.o_norm_K.astype(F32), state_BHKV, valid_B.astype(jnp.int32), pos_B.astype(jnp.int32), w_o)
    return jnp.sum(p, axis=0)[None], conv, state


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
    if not (pow2(c.parts) and pow2(c.bv) and pow2(c.bn)) or Kd % min(c.bv, Kd) or N % (c.parts * c.bn):
        return (f"kda_decode_out kernel: parts {c.parts}, bv {c.bv}, bn {c.bn} must be powers of two, bv dividing the "
                f"head dim {Kd} and parts x bn dividing o_proj's {N} rows")
    if only_where_faster and (C, H, d, N, jnp.dtype(dt)) not in OUT_MEASURED:
        return (f"kda_decode_out kernel: auto takes it where the step was measured faster with it ((C, H, d, N, dtype) "
                f"in {sorted(map(str, OUT_MEASURED))}), got {(C, H, d, N, str(jnp.dtype(dt)))}")
    return None


register(Kernel("kda_decode_out", reference, kda_decode_out, platforms=("gpu",), fits=fits,
                unproven="built in the thirty-eighth session; its compiled tests not yet run on a GPU",
                measured="not measured"))
