"""The KDA decode step between the projections and o_proj as one Pallas kernel (and the gated output
norm as one XLA fusion), beside its jnp reference `decode_core` (with the gate and the l2 norm the
chunked prefill shares).

XLA runs this part as ~20 small kernels per KDA layer (conv, SiLU, two l2 norms, the gate, the
decay, two state contractions, the rank-1 update, the gated norm, two cache selects).  Here one
grid program owns one (row, local head, block of `Config.bv` value columns): it reads the head's
K-1 cached projections per tap and its new q/k (all Kd channels) and v (its block) projections, does
the causal conv + SiLU, the l2 norms, the forget gate and beta, the gated delta rule on its [Kd, bv]
columns of the head's fp32 state (in registers), and writes its output columns, its state columns and
its conv windows (rows with valid False keep both caches).  The gated RMSNorm spans the head's Kd
values, so it runs after the kernel, in jnp (`gated_rms_norm`).

`kda_decode_in` is the same kernel reading the serving layout's in_proj output [q | k | v | f_a | b | g_a] and the
stacked low-rank weights [f_b, g_b] itself (Kimi-Linear): the split, the casts, the q|k|v stack, beta's sigmoid
and the two low-rank products (`glue`, five XLA kernels per layer) happen in its programs, which also write z
for the norm after it.

The conv window is kept in one of two layouts, which the cache's last dim tells apart:
- the shift form (W = K-1 slots, oldest first): the kernel writes the moved window to a new buffer, which XLA then
  copies back into the cache (the kernel reads the donated buffer its output would replace; 1.35 us a KDA layer on
  the H200, docs/PERF.md);
- the ring (`RING`; K slots, a token at position p in slot p mod K, `pos_B` the row's next position): the new
  projection goes to slot pos mod K, which none of this step's programs reads (they read the other K-1), so the
  window is written in place and XLA's copy goes.  The same values as the shift form, bitwise.

Every value is float32 as in the reference; the conv taps and the state contractions are summed in
another order, so results agree to float32 rounding (tests/test_kernels.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxk3.config import KimiK3Config
from jaxk3.kernels.registry import Kernel, register
from jaxk3.kernels.rms_norm import gated_rms_norm

F32 = jnp.float32

# The conv cache as a ring of K slots (written in place) instead of K-1 shifted ones: `jaxk3.layers.kda.cache_abstract`
# reads this when it lays out a cache.  On since the thirteenth session's A/B (docs/PERF.md: the 48B step at B = 1
# 2437.3 us against main's 2467.4 and 2461.2 in the same call, 20 launches fewer; B = 8 even); the shift form
# stays for caches laid out with it off (`is_ring` tells them apart by the last dim).
RING = True


def is_ring(cfg: KimiK3Config, conv_B3CW) -> bool:
    """Whether a conv cache is laid out as the ring (K slots) rather than the shift form (K-1): its last dim says."""
    return conv_B3CW.shape[-1] == cfg.short_conv_kernel_size


def ring_window(conv_B3CK: jax.Array, pos_B: jax.Array) -> jax.Array:
    """The ring's K-1 cached projections in the shift form's order (oldest first): [B, 3, C, K-1], tap t from slot
    (pos + 1 + t) mod K."""
    K = conv_B3CK.shape[-1]
    slot_BT = jax.lax.rem(pos_B.astype(jnp.int32)[:, None] + 1 + jnp.arange(K - 1, dtype=jnp.int32), K)
    return jnp.take_along_axis(conv_B3CK, slot_BT[:, None, None, :], axis=-1)


def ring_place(entries_B3CK: jax.Array, end_B: jax.Array) -> jax.Array:
    """The ring holding K consecutive projections: entry j (position end - K + j) in slot (end - K + j) mod K."""
    K = entries_B3CK.shape[-1]
    end_B = jnp.asarray(end_B, jnp.int32)
    idx_BK = jax.lax.rem(jnp.arange(K, dtype=jnp.int32)[None] - end_B[:, None] % K + K, K)  # slot j <- entry
    return jnp.take_along_axis(entries_B3CK, idx_BK[:, None, None, :], axis=-1)


def ring_put(conv_B3CK: jax.Array, pos_B: jax.Array, u_B3C: jax.Array, keep_B: jax.Array) -> jax.Array:
    """The ring with the projections at position pos in slot pos mod K (rows with keep_B False as they were)."""
    K = conv_B3CK.shape[-1]
    hit_BK = (jnp.arange(K, dtype=jnp.int32)[None] == jax.lax.rem(pos_B.astype(jnp.int32), K)[:, None]) & keep_B[:, None]
    return jnp.where(hit_BK[:, None, None, :], u_B3C[..., None].astype(conv_B3CK.dtype), conv_B3CK)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def kda_gate(f_BHK: jax.Array, A_log_H: jax.Array, gate_lower_bound: float | None) -> jax.Array:
    """Log-space forget gate g (fp32); f already includes dt_bias."""
    return log_gate(jnp.exp(A_log_H.astype(F32))[None, :, None], f_BHK.astype(F32), gate_lower_bound)


def log_gate(a, f, gate_lower_bound: float | None):
    """The gate g from a = exp(A_log) and f (float32, broadcast alike): lb·sigmoid(a·f) with a lower bound (K3: g in
    (lb, 0)), else -a·softplus(f).  `kda_gate` and the decode kernel's programs (a scalar a per head) share it."""
    if gate_lower_bound is not None:
        return gate_lower_bound * jax.nn.sigmoid(a * f)
    return -a * jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(jnp.minimum(f, 20.0))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CoreWeights:
    """The small per-channel weights `decode_core` reads (local shards)."""
    conv_3CK: jax.Array  # q|k|v conv taps, fp32
    dt_bias_C: jax.Array  # fp32
    A_log_H: jax.Array  # fp32
    o_norm_K: jax.Array  # fp32


def decode_core(cfg: KimiK3Config, u_B3C: jax.Array, conv_B3CW: jax.Array, cw: CoreWeights, f_BC: jax.Array,
                beta_BH: jax.Array, z_BC: jax.Array, state_BHKV: jax.Array, valid_B: jax.Array, gated: bool = True,
                pos_B: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Everything of the KDA decode step between the projections and o_proj, per local head:
    the short causal conv + SiLU, the q/k l2 norms, the forget gate, the gated delta rule on the
    fp32 state and the gated output RMSNorm.  (o_BC fp32, new conv_B3CW, new state_BHKV); rows with
    valid_B False keep their caches.  The jnp reference of the `kda_decode` kernel.  `gated` False: o
    before the gated norm (o_proj's prologue norms it: jaxk3.kernels.gemv.gemv_gnorm).  `pos_B` given: the conv
    cache is the ring (`RING`) and pos_B [B] int32 each row's position of this token."""
    B, Kd = u_B3C.shape[0], cfg.kda_head_dim
    older = conv_B3CW if pos_B is None else ring_window(conv_B3CW, pos_B)
    win_B3CK = jnp.concatenate([older, u_B3C[..., None]], axis=-1)
    y_B3C = jax.nn.silu(jnp.einsum("bjck,jck->bjc", win_B3CK.astype(F32), cw.conv_3CK))
    q_BHK, k_BHK, v_BHK = (y_B3C[:, j].reshape(B, -1, Kd) for j in range(3))
    q_BHK = l2norm(q_BHK) * Kd ** -0.5
    k_BHK = l2norm(k_BHK)
    f_BHK = (f_BC + cw.dt_bias_C.astype(F32)).reshape(B, -1, Kd)
    g_BHK = kda_gate(f_BHK, cw.A_log_H, cfg.gate_lower_bound)
    # -- gated delta rule, fp32 state [K, Vd] per head
    S = state_BHKV * jnp.exp(g_BHK)[..., None]
    pred_BHV = jnp.einsum("bhkv,bhk->bhv", S, k_BHK)
    upd_BHV = beta_BH[..., None] * (v_BHK - pred_BHV)
    S = S + jnp.einsum("bhk,bhv->bhkv", k_BHK, upd_BHV)
    o_BHV = jnp.einsum("bhkv,bhk->bhv", S, q_BHK)
    if gated:
        o_BHV = gated_rms_norm(o_BHV, cw.o_norm_K, z_BC.reshape(o_BHV.shape), cfg.rms_norm_eps)
    keep = valid_B.astype(bool)
    if pos_B is None:
        new_conv = jnp.where(keep[:, None, None, None], win_B3CK[..., 1:], conv_B3CW)
    else:
        new_conv = ring_put(conv_B3CW, pos_B, u_B3C, keep)
    new_state = jnp.where(keep[:, None, None, None], S, state_BHKV)
    return o_BHV.reshape(B, -1), new_conv, new_state


@dataclasses.dataclass(frozen=True)
class Config:
    bv: int = 32  # value columns of the state per program (a power of two; the head's Kd when larger)
    num_warps: int = 4


def _kernel(*refs, Kd: int, W: int, bv: int, lb: float | None, fused: tuple[int, int, int] | None,
            ring: bool = False):
    """`fused` None: the inputs are the projections' parts (u, f, beta; z is the wrapper's).  `fused` = (C, H, d):
    the in_proj GEMV's raw output y = [q | k | v | f_a | b | g_a] (fp32) and the stacked low-rank weights
    [f_b, g_b] [2, C, d]: the program takes its parts of y, casts them as the reference does, forms f (its head's
    channels) and z (its value channels) by the two low-rank products, and writes z for the wrapper's norm.
    `ring`: the conv cache is the ring of W = K slots (the output aliases it) and one more input, the rows'
    positions; else the shift form's W = K-1 slots, moved into a new buffer."""
    from jax.experimental import pallas as pl

    if ring:  # the positions come last among the inputs
        *ins, pos_ref = refs[:-(4 if fused else 3)]
        refs = (*ins, *refs[-(4 if fused else 3):])
    if fused:
        y_ref, gb_ref, conv_ref, cw_ref, dtb_ref, alog_ref, s_ref, valid_ref, o_ref, z_ref, conv_out_ref, s_out_ref = refs
        C, H, d = fused
    else:
        u_ref, conv_ref, cw_ref, dtb_ref, alog_ref, f_ref, beta_ref, s_ref, valid_ref, o_ref, conv_out_ref, s_out_ref = refs
    dt = conv_out_ref.dtype
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ch = pl.ds(h * Kd, Kd)  # the head's q/k channels (every program recomputes them: K taps of Kd values)
    cv = pl.ds(h * Kd + j * bv, bv)  # this program's value channels
    vs = pl.ds(j * bv, bv)  # its columns of the state

    def U(i, chans):  # the raw projection of q (0), k (1) or v (2) at `chans`, in the activation dtype
        if fused:
            return y_ref[b, pl.ds(i * C + chans.start, chans.size)].astype(dt)
        return u_ref[b, i, chans]

    n_old = W - 1 if ring else W  # the cached taps (K-1)
    if ring:
        pos = pos_ref[b]

        def slot(t):  # the ring's slot of cached tap t (0 the oldest); slot(n_old) takes this token
            return jax.lax.rem(pos + (t + 1) % W, W)
    else:
        def slot(t):
            return t

    def conv(i, chans):  # conv over the K-1 cached taps and the new projection, then SiLU
        acc = U(i, chans).astype(F32) * cw_ref[i, chans, n_old]
        for t in range(n_old):
            acc = acc + conv_ref[b, i, chans, slot(t)].astype(F32) * cw_ref[i, chans, t]
        return acc * jax.nn.sigmoid(acc)
    q, k, v = conv(0, ch), conv(1, ch), conv(2, cv)
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * Kd ** -0.5
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)
    if fused:  # the low-rank products of f_a and g_a (in the activation dtype, fp32 sums), as `glue`
        fb, gbv = gb_ref[0, ch, :], gb_ref[1, cv, :]
        fa = y_ref[b, pl.ds(3 * C, d)].astype(dt).astype(F32)
        f = jnp.sum(fb.astype(F32) * fa[None, :], axis=1)
        ga = y_ref[b, pl.ds(3 * C + d + H, d)].astype(dt).astype(F32)
        z_ref[b, cv] = jnp.sum(gbv.astype(F32) * ga[None, :], axis=1)
        beta = jax.nn.sigmoid(y_ref[b, 3 * C + d + h])
    else:
        f, beta = f_ref[b, ch].astype(F32), beta_ref[b, h]
    f = f + dtb_ref[ch]
    g = log_gate(jnp.exp(alog_ref[h]), f, lb)
    S0 = s_ref[b, h, :, vs]
    S = S0 * jnp.exp(g)[:, None]  # [K, bv]
    pred = jnp.sum(S * k[:, None], axis=0)  # [bv]
    upd = beta * (v - pred)
    S = S + k[:, None] * upd[None, :]
    o_ref[b, cv] = jnp.sum(S * q[:, None], axis=0)  # before the gated RMSNorm over the head (the wrapper's)
    keep = valid_ref[b] != 0
    s_out_ref[b, h, :, vs] = jnp.where(keep, S, S0)
    for i, chans, own in ((0, ch, j == 0), (1, ch, j == 0), (2, cv, True)):  # q and k windows: one program writes
        @pl.when(own)
        def _():
            if ring:  # this token's slot (the oldest value's, which no program of this step reads), in place
                s_new = slot(n_old)
                conv_out_ref[b, i, chans, s_new] = jnp.where(keep, U(i, chans), conv_ref[b, i, chans, s_new])
                return
            for t in range(W):  # the window moves one tap: the oldest drops, the new projection enters
                new = U(i, chans) if t == W - 1 else conv_ref[b, i, chans, t + 1]
                conv_out_ref[b, i, chans, t] = jnp.where(keep, new, conv_ref[b, i, chans, t])


def kda_decode(cfg, u_B3C, conv_B3CW, cw, f_BC, beta_BH, z_BC, state_BHKV, valid_B, interpret: bool = False,
               config: Config | None = None, pos_B: jax.Array | None = None):
    """The same function as the reference: (o_BC fp32, new conv_B3CW, new state_BHKV).  The grid is
    (row, head, value block): a head's state is split by value columns over `Config.bv`, so that a
    Kimi-Linear step at B = 1 runs 128 programs of 16 KB of state instead of 32 of 64 KB (the K-long
    contractions stay inside a program); the output's gated RMSNorm, which spans the head's values, is
    applied to the kernel's output by XLA (one fusion with the cast that feeds o_proj)."""
    from jax.experimental import pallas as pl

    from jaxk3.kernels.registry import triton_params

    c = config or Config()
    B, _, C = u_B3C.shape
    H, Kd = state_BHKV.shape[1], cfg.kda_head_dim
    bv = min(c.bv, Kd)
    W = conv_B3CW.shape[-1]
    ring = pos_B is not None
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, Kd=Kd, W=W, bv=bv, lb=cfg.gate_lower_bound, fused=None, ring=ring)
    extra = (pos_B.astype(jnp.int32),) if ring else ()
    o, conv, state = pl.pallas_call(
        kernel, grid=(B, H, Kd // bv), in_specs=[any_] * (9 + ring), out_specs=[any_] * 3,
        out_shape=(jax.ShapeDtypeStruct((B, C), F32), jax.ShapeDtypeStruct(conv_B3CW.shape, conv_B3CW.dtype),
                   jax.ShapeDtypeStruct(state_BHKV.shape, F32)),
        # the state is updated in place (each program reads and writes only its own columns); the shift form's conv
        # windows are not (a head's programs all read its q/k windows, which one of them rewrites), the ring's are
        input_output_aliases={7: 2, 1: 1} if ring else {7: 2}, interpret=interpret, name="kda_step",
        **triton_params(c.num_warps, 1, interpret),
    )(u_B3C, conv_B3CW, cw.conv_3CK, cw.dt_bias_C.astype(F32), cw.A_log_H.astype(F32), f_BC, beta_BH.astype(F32),
      state_BHKV, valid_B.astype(jnp.int32), *extra)
    o = gated_rms_norm(o.reshape(B, H, Kd), cw.o_norm_K, z_BC.reshape(B, H, Kd), cfg.rms_norm_eps)
    return o.reshape(B, C), conv, state


def reference(cfg, u_B3C, conv_B3CW, cw, f_BC, beta_BH, z_BC, state_BHKV, valid_B, config: Config | None = None,
              pos_B: jax.Array | None = None):
    return decode_core(cfg, u_B3C, conv_B3CW, cw, f_BC, beta_BH, z_BC, state_BHKV, valid_B, pos_B=pos_B)


def fits(cfg, u_B3C, conv_B3CW, cw, f_BC, beta_BH, z_BC, state_BHKV, valid_B, config: Config | None = None,
         pos_B: jax.Array | None = None, **_) -> str | None:
    Kd = cfg.kda_head_dim
    if Kd & (Kd - 1) or Kd > 256:
        return f"kda_decode kernel needs a power-of-two head_dim <= 256 (Triton blocks), got {Kd}"
    bv = (config or Config()).bv
    if bv & (bv - 1) or bv < 1:
        return f"kda_decode kernel: Config.bv must be a power of two, got {bv}"
    if u_B3C.ndim != 3 or conv_B3CW.shape[-1] < 1:
        return f"kda_decode kernel takes one token per row: u {u_B3C.shape}, conv {conv_B3CW.shape}"
    if state_BHKV.dtype != jnp.float32:  # updated in place: the new state (float32) takes the old one's buffer
        return f"kda_decode kernel updates a float32 state in place, got {state_BHKV.dtype}"
    return window_error(cfg, conv_B3CW, pos_B, "kda_decode kernel")


def window_error(cfg: KimiK3Config, conv_B3CW, pos_B, who: str) -> str | None:
    """Why the conv cache does not suit `pos_B` (None: it does): the ring holds K slots and needs the rows'
    positions, the shift form K-1 and none."""
    K, W = cfg.short_conv_kernel_size, conv_B3CW.shape[-1]
    if pos_B is None and W != K - 1:
        return (f"{who}: the conv cache {tuple(conv_B3CW.shape)} must hold K-1 = {K - 1} slots (or K = {K} as a ring "
                f"with the rows' positions)")
    if pos_B is not None and (not is_ring(cfg, conv_B3CW) or tuple(pos_B.shape) != (conv_B3CW.shape[0],)):
        return (f"{who}: the ring conv cache {tuple(conv_B3CW.shape)} must hold K = {K} slots and the positions one "
                f"per row, got {tuple(pos_B.shape)}")
    return None


def glue(cfg: KimiK3Config, y_NX: jax.Array, gate_b_2Cd: jax.Array, dt) -> tuple[jax.Array, ...]:
    """The serving layout's in_proj output y = [q | k | v | f_a | b | g_a] (fp32, the local channels C, heads H
    and low rank d) and the stacked low-rank weights [f_b, g_b] [2, C, d], made the decode core's inputs:
    (u_N3C the raw q|k|v projections in `dt`, f_NC, beta_NH, z_NC), as jaxk3.layers.kda.projections computes
    them (its serving-layout branch is this): one batched product of [f_a, g_a] in `dt` with fp32 sums."""
    C, d = gate_b_2Cd.shape[1], gate_b_2Cd.shape[2]
    H = y_NX.shape[-1] - 3 * C - 2 * d
    q, k, v, fa, b, g = (y_NX[:, o:o + n] for o, n in zip((0, C, 2 * C, 3 * C, 3 * C + d, 3 * C + d + H),
                                                          (C, C, C, d, H, d)))
    u_N3C = jnp.stack([q, k, v], 1).astype(dt)
    fg = jnp.einsum("njd,jcd->njc", jnp.stack([fa, g], 1).astype(dt), gate_b_2Cd, preferred_element_type=F32)
    return u_N3C, fg[:, 0], jax.nn.sigmoid(b), fg[:, 1]


# (B, local channels C, heads H, low rank d, activation dtype) where the step was measured faster with kda_decode_in:
# Kimi-Linear-48B at TP 1, B = 1 (docs/PERF.md, 2026-12-02, fourth session).
IN_MEASURED = {(1, 4096, 32, 128, jnp.dtype(jnp.bfloat16))}


def fused_reference(cfg, y_BX, gate_b_2Cd, conv_B3CW, cw, state_BHKV, valid_B, config: Config | None = None,
                    only_where_faster: bool = True, gated: bool = True, pos_B: jax.Array | None = None):
    """`kda_decode_in`'s reference: `glue`, then `decode_core` (what the layer computes without the kernel).
    `gated` False: (o before the gated norm, z, new conv, new state), for o_proj's prologue to norm."""
    u, f, beta, z = glue(cfg, y_BX, gate_b_2Cd, conv_B3CW.dtype)
    o, conv, state = decode_core(cfg, u, conv_B3CW, cw, f, beta, z, state_BHKV, valid_B, gated=gated, pos_B=pos_B)
    return (o, conv, state) if gated else (o, z, conv, state)


def kda_decode_in(cfg, y_BX, gate_b_2Cd, conv_B3CW, cw, state_BHKV, valid_B, interpret: bool = False,
                  config: Config | None = None, only_where_faster: bool = True, gated: bool = True,
                  pos_B: jax.Array | None = None):
    """The same function as `fused_reference`: the kernel reads in_proj's raw output and the low-rank weights
    itself (the XLA kernels that split, stack, cast and multiply them go), writing z beside o for the norm
    (`gated` False: o and z as they are, the norm left to o_proj's prologue)."""
    from jax.experimental import pallas as pl

    from jaxk3.kernels.registry import triton_params

    c = config or Config()
    B = y_BX.shape[0]
    C, d = gate_b_2Cd.shape[1], gate_b_2Cd.shape[2]
    H, Kd = state_BHKV.shape[1], cfg.kda_head_dim
    bv = min(c.bv, Kd)
    W = conv_B3CW.shape[-1]
    ring = pos_B is not None
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, Kd=Kd, W=W, bv=bv, lb=cfg.gate_lower_bound, fused=(C, H, d), ring=ring)
    extra = (pos_B.astype(jnp.int32),) if ring else ()
    o, z, conv, state = pl.pallas_call(
        kernel, grid=(B, H, Kd // bv), in_specs=[any_] * (8 + ring), out_specs=[any_] * 4,
        out_shape=(jax.ShapeDtypeStruct((B, C), F32), jax.ShapeDtypeStruct((B, C), F32),
                   jax.ShapeDtypeStruct(conv_B3CW.shape, conv_B3CW.dtype), jax.ShapeDtypeStruct(state_BHKV.shape, F32)),
        input_output_aliases={6: 3, 2: 2} if ring else {6: 3}, interpret=interpret, name="kda_step_in",
        **triton_params(c.num_warps, 1, interpret),
    )(y_BX.astype(F32), gate_b_2Cd, conv_B3CW, cw.conv_3CK, cw.dt_bias_C.astype(F32), cw.A_log_H.astype(F32),
      state_BHKV, valid_B.astype(jnp.int32), *extra)
    if not gated:
        return o, z, conv, state
    o = gated_rms_norm(o.reshape(B, H, Kd), cw.o_norm_K, z.reshape(B, H, Kd), cfg.rms_norm_eps)
    return o.reshape(B, C), conv, state


def fused_fits(cfg, y_BX, gate_b_2Cd, conv_B3CW, cw, state_BHKV, valid_B, config: Config | None = None,
               only_where_faster: bool = True, pos_B: jax.Array | None = None, **_) -> str | None:
    """Why this call does not suit `kda_decode_in` (None: it does).  `auto` takes it where the step was measured
    faster with it (`IN_MEASURED`: one row, bf16 activations, Kimi-Linear-48B's per-rank dims at TP 1);
    only_where_faster=False (kernels="on") wherever it fits."""
    if only_where_faster and gate_b_2Cd.ndim == 3 and y_BX.ndim == 2:
        at = (y_BX.shape[0], gate_b_2Cd.shape[1], state_BHKV.shape[1], gate_b_2Cd.shape[2], jnp.dtype(conv_B3CW.dtype))
        if at not in IN_MEASURED:
            return (f"kda_decode_in kernel: auto takes it where the step was measured faster with it (B, C, H, d, "
                    f"dtype in {sorted(map(str, IN_MEASURED))}), got {at}")
    if gate_b_2Cd.ndim != 3 or gate_b_2Cd.shape[0] != 2:
        return f"kda_decode_in kernel takes the stacked [f_b, g_b] [2, C, d], got {gate_b_2Cd.shape}"
    C, d = gate_b_2Cd.shape[1], gate_b_2Cd.shape[2]
    H = state_BHKV.shape[1]
    if y_BX.ndim != 2 or y_BX.shape[1] != 3 * C + 2 * d + H or conv_B3CW.shape[2] != C:
        return (f"kda_decode_in kernel: in_proj's output must be [B, 3C + 2d + H] = [B, {3 * C + 2 * d + H}] for C "
                f"{C}, d {d}, H {H}, got {y_BX.shape} (conv {conv_B3CW.shape})")
    if d & (d - 1) or d > 256:
        return f"kda_decode_in kernel needs a power-of-two low rank <= 256 (Triton blocks), got {d}"
    u = jax.ShapeDtypeStruct((y_BX.shape[0], 3, C), conv_B3CW.dtype)
    return fits(cfg, u, conv_B3CW, cw, None, None, None, state_BHKV, valid_B, config, pos_B=pos_B)


# Proven on an H200: the compiled real-dims tests (tests/test_kernels_real.py, K3 TP 1/2/8 and Kimi-Linear-48B,
# B 1 and 8) passed (2026-12-01 and, split by value columns, 2026-12-02 third session; with the state in place:
# the tiny-dims tests and K3 TP 1 at real dims), and it beats the XLA path at each of those shapes.
register(Kernel("kda_decode", reference, kda_decode, platforms=("gpu",), fits=fits,
                measured="1.33-7.3x XLA at B=1, 1.66-1.87x at B=8, K3 TP 1/2/8 and Kimi-Linear-48B (32 value "
                         "columns per program; H200, jax 0.11.2, 2026-12-02; docs/PERF.md)"))

# The decode core reading in_proj's output and the low-rank weights itself (Kimi-Linear's serving layout).  Proven
# on an H200 (2026-12-02, fourth session): compiled tests at the tiny dims and at Kimi-Linear-48B's (B 1 and 8), and
# the 48B step at B = 1 took 2657.5 us with it against 2705.5 without in the same call (docs/PERF.md).
register(Kernel("kda_decode_in", fused_reference, kda_decode_in, platforms=("gpu",), fits=fused_fits,
                measured="B=1, Kimi-Linear-48B TP 1: the step 1.8% faster with it (2657.5 vs 2705.5 us, 100 fewer "
                         "kernels); elsewhere not measured, auto keeps kda_decode (H200, jax 0.11.2, 2026-12-02); "
                         "with the conv window as the ring (RING) the step a further 1.1% faster, 2437.3 vs 2467.4 / "
                         "2461.2 us, 20 fewer kernels (2026-12-03)"))
