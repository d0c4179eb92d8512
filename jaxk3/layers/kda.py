"""Kimi Delta Attention (KDA), one decode token (docs/SPEC.md §3.2).

Per head h (d = head_dim), for the normed input x:

    u       = [W_q x | W_k x | W_v x]                       raw projections (activation dtype)
    y       = silu(Σ_i w[i]·[conv_state | u][i])             depthwise causal conv, K taps, no bias
    q, k, v = y split;  q ← l2norm(q)·d^-½,  k ← l2norm(k)     (l2norm eps 1e-6 inside the sqrt)
    f       = W_fb (W_fa x) + dt_bias
    g       = lb·sigmoid(exp(A_log)·f)          K3 (gate_lower_bound lb = -5)
            = -exp(A_log)·softplus(f)            Kimi-Linear
    β       = sigmoid(W_b x)
    S       ← diag(exp(g)) S;   S ← S + k ⊗ β(v − Sᵀk);   o = Sᵀq        (S [K, Vd], fp32, fla layout)
    z       = W_g x (K3 full rank)  |  W_gb (W_ga x) (Kimi-Linear)
    out     = W_o · concat_h( RMSNorm(o_h; o_norm) ⊙ sigmoid(z_h) )        row-parallel → psum

Caches per layer: conv_B3CW (the last K-1 raw q|k|v projections, oldest first, activation dtype; or, laid out
with `jaxk3.kernels.kda_decode.RING`, a ring of K slots, the projection of position p in slot p mod K, which the
step writes in place and reads with the rows' positions) and state_BHKV (fp32).  Under TP every array here holds the local heads only; `o_proj` is
row-parallel and its partial is psum-ed.  Rows with `valid_B == False` leave their caches as they
were (used for left padding of ragged prompts).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jaxk3 import kernels
from jaxk3.config import KimiK3Config
from jaxk3.kernels import kda_decode as kda_kernels
from jaxk3.kernels.kda_decode import CoreWeights, glue, kda_gate, l2norm, ring_place, ring_window
from jaxk3.kernels.rms_norm import gated_rms_norm
from jaxk3.layers.common import F32, TP, Normed, kernel_mode, linear, psum, split
from jaxk3.params import COL, REP, ROW, Buffer, Fuse, Param, weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KDAWeights:
    """HF `model.layers.{l}.self_attn.<field>[.weight]`; shapes global (TP shards the C/H axis)."""
    q_proj: jax.Array  # [C, D]
    k_proj: jax.Array  # [C, D]
    v_proj: jax.Array  # [C, D]
    q_conv1d: jax.Array  # [C, 1, K] fp32
    k_conv1d: jax.Array  # [C, 1, K] fp32
    v_conv1d: jax.Array  # [C, 1, K] fp32
    f_a_proj: jax.Array  # [d, D]   replicated
    f_b_proj: jax.Array  # [C, d]
    b_proj: jax.Array  # [H, D]
    A_log: jax.Array  # [H] fp32 (checkpoint [1,1,H,1] or [>=H]; normalised by the loader)
    dt_bias: jax.Array  # [C] fp32
    o_norm: jax.Array  # [d] fp32, shared by the heads
    o_proj: jax.Array  # [D, C]
    g_proj: jax.Array | None = None  # [C, D]   K3 full-rank output gate
    g_a_proj: jax.Array | None = None  # [d, D]   Kimi-Linear low-rank output gate (replicated)
    g_b_proj: jax.Array | None = None  # [C, d]
    # the serving layout (params.Fuse, made at load; the checkpoint keeps the members above)
    in_proj: jax.Array | None = None  # per rank [q | k | v | f_a | b | g or g_a] rows, [*, D]
    gate_b_proj: jax.Array | None = None  # [2, C, d]  f_b and g_b stacked (Kimi-Linear)
    conv1d: jax.Array | None = None  # [3, C, 1, K] the q | k | v conv taps stacked (the decode kernel's operand)

    FUSE = (Fuse("in_proj", ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_proj")),
            Fuse("in_proj", ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_a_proj")),
            Fuse("gate_b_proj", ("f_b_proj", "g_b_proj"), "stack"),
            Fuse("conv1d", ("q_conv1d", "k_conv1d", "v_conv1d"), "stack"))


def abstract(cfg: KimiK3Config, prefix: str) -> KDAWeights:
    """The weights of one KDA layer (`prefix` = `model.layers.{l}.self_attn.`), declared once."""
    D, C, H, d, K = cfg.hidden_size, cfg.kda_dim, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size

    def w(field, shape, spec, **kw):
        return weight(shape, prefix, field, spec=spec, group="kda", **kw)

    conv = dict(spec=P("tp", None, None), dtype="fp32", init="conv")
    gates = (dict(g_proj=w("g_proj", (C, D), COL)) if cfg.use_full_rank_gate else
             dict(g_a_proj=w("g_a_proj", (d, D), REP), g_b_proj=w("g_b_proj", (C, d), COL)))
    return KDAWeights(
        q_proj=w("q_proj", (C, D), COL), k_proj=w("k_proj", (C, D), COL), v_proj=w("v_proj", (C, D), COL),
        q_conv1d=w("q_conv1d", (C, 1, K), **conv), k_conv1d=w("k_conv1d", (C, 1, K), **conv),
        v_conv1d=w("v_conv1d", (C, 1, K), **conv),
        f_a_proj=w("f_a_proj", (d, D), REP), f_b_proj=w("f_b_proj", (C, d), COL), b_proj=w("b_proj", (H, D), COL),
        # K3 checkpoints list A_log as [128] (the first H used), Kimi-Linear as [1, 1, H, 1] (docs/SPEC.md §2)
        A_log=Param((H,), (prefix + "A_log",), P("tp"), dtype="fp32", init="a_log", group="kda", source="a_log",
                    ckpt_shape=(H,) if cfg.gate_lower_bound is not None else (1, 1, H, 1)),
        dt_bias=w("dt_bias", (C,), P("tp"), dtype="fp32", init="dt"),
        o_norm=w("o_norm", (d,), REP, dtype="fp32", init="norm"), o_proj=w("o_proj", (D, C), ROW), **gates)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KDACache:
    """Decode state of one KDA layer for B rows (TP splits C / H)."""
    conv: jax.Array  # [B, 3, C, W]  the last W = K-1 raw q|k|v projections, oldest first, activation dtype (W = K: the ring)
    state: jax.Array  # [B, H, K, Vd] recurrent state, fp32, fla layout (vLLM stores [H, Vd, K])


def cache_abstract(cfg: KimiK3Config, batch: int) -> KDACache:
    """The layer's caches for `batch` rows; the conv window as the ring of K slots where `kda_decode.RING` is set."""
    d, K = cfg.kda_head_dim, cfg.short_conv_kernel_size
    return KDACache(conv=Buffer((batch, 3, cfg.kda_dim, K if kda_kernels.RING else K - 1), "compute", tp_dim=2),
                    state=Buffer((batch, cfg.kda_num_heads, d, d), "fp32", tp_dim=1))


def ring_positions(cfg: KimiK3Config, conv_B3CW: jax.Array, pos_B: jax.Array | None) -> jax.Array | None:
    """The rows' positions where the conv cache is the ring (K slots), else None (the shift form's K-1)."""
    K, W = cfg.short_conv_kernel_size, conv_B3CW.shape[-1]
    if W == K - 1:
        return None
    if not kda_kernels.is_ring(cfg, conv_B3CW):
        raise ValueError(f"KDA conv cache {tuple(conv_B3CW.shape)}: its last dim must be K-1 = {K - 1} (the shift "
                         f"form) or K = {K} (the ring), from short_conv_kernel_size {K}")
    if pos_B is None:
        raise ValueError(f"KDA conv cache {tuple(conv_B3CW.shape)} is a ring of K = {K} slots: the step needs the "
                         f"rows' positions (pos_B)")
    return pos_B


def _core_then_gnorm_o_proj(cfg: KimiK3Config, w: KDAWeights, args: tuple, dt, mode: str, tp, pos_B):
    """kda_decode_in leaving o un-normed, then o_proj with the gated per-head norm in its prologue (`gemv_gnorm`),
    where that kernel runs: (out_BD, new conv, new state); else None."""
    o_sd = jax.ShapeDtypeStruct((args[1].shape[0], w.o_proj.shape[1]), jnp.float32)
    gargs = (o_sd, o_sd, w.o_norm, cfg.rms_norm_eps, w.o_proj, dt)
    if not kernels.explain("gemv_gnorm", *gargs, mode=mode).startswith("device"):
        return None
    o_BC, z_BC, new_conv, new_state = kernels.call("kda_decode_in", *args, mode=mode, gated=False, pos_B=pos_B)
    out = kernels.call("gemv_gnorm", o_BC, z_BC, w.o_norm, cfg.rms_norm_eps, w.o_proj, dt, mode=mode)
    return psum(out, tp), new_conv, new_state


def kda_step(cfg: KimiK3Config, w: KDAWeights, x_BD: jax.Array | Normed, conv_B3CW: jax.Array,
             state_BHKV: jax.Array, valid_B: jax.Array, tp: TP | str | None, pos_B: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One KDA decode step on the normed input (or a `Normed`, which the first GEMV norms).  Returns (out_BD fp32
    summed over TP, new conv_B3CW, new state_BHKV).  `pos_B` [B] int32, each row's position of this token (the
    cache's length), is read where the conv cache is the ring."""
    dt = x_BD.dtype
    mode = kernel_mode(tp)
    pos_B = ring_positions(cfg, conv_B3CW, pos_B)
    cw = core_weights(w)
    # -- projections (GEMVs); the rest of the step is `decode_core` (one device kernel where it runs)
    parts = None
    if w.in_proj is not None and w.gate_b_proj is not None:  # Kimi-Linear's serving layout
        y_BX = linear(x_BD, w.in_proj, tp)  # [q | k | v | f_a | b | g_a], fp32
        args = (cfg, y_BX, w.gate_b_proj, conv_B3CW, cw, state_BHKV, valid_B)
        if kernels.explain("kda_decode_in", *args, mode=mode, pos_B=pos_B).startswith("device"):  # the glue inside
            out = _core_then_gnorm_o_proj(cfg, w, args, dt, mode, tp, pos_B)
            if out is not None:
                return out
            o_BC, new_conv, new_state = kernels.call("kda_decode_in", *args, mode=mode, pos_B=pos_B)
        else:
            parts = glue(cfg, y_BX, w.gate_b_proj, dt)
    else:
        parts = projections(cfg, w, x_BD, tp)
    if parts is not None:
        u_B3C, f_BC, beta_BH, z_BC = parts
        o_BC, new_conv, new_state = kernels.call(
            "kda_decode", cfg, u_B3C, conv_B3CW, cw, f_BC, beta_BH, z_BC, state_BHKV, valid_B, mode=mode, pos_B=pos_B)
    out_BD = psum(linear(o_BC.astype(dt), w.o_proj, tp), tp)
    return out_BD, new_conv, new_state


def projections(cfg: KimiK3Config, w: KDAWeights, x_ND: jax.Array, tp: TP | str | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The layer's GEMVs on N tokens (decode: the batch; prefill: B·T): (u_N3C the raw q|k|v
    projections in x's dtype, f_NC the forget-gate input without dt_bias, beta_NH, z_NC the output
    gate), fp32 except u.  In the serving layout one GEMV (`in_proj`) computes every projection of x
    and one batched product (`gate_b_proj`) the two low-rank second halves; in the checkpoint layout,
    one GEMV per weight (the same values; the sums of a fused product may run in another order)."""
    dt = x_ND.dtype
    if w.in_proj is not None and w.gate_b_proj is not None:  # Kimi-Linear's serving layout
        return glue(cfg, linear(x_ND, w.in_proj, tp), w.gate_b_proj, dt)
    if w.in_proj is not None:
        c, h, d = w.dt_bias.shape[0], w.A_log.shape[0], cfg.kda_head_dim  # local channels and heads
        q, k, v, fa, b, g = split(linear(x_ND, w.in_proj, tp), (c, c, c, d, h, c if cfg.use_full_rank_gate else d))
    else:
        q, k, v, fa, b, g = (linear(x_ND, m, tp) for m in (w.q_proj, w.k_proj, w.v_proj, w.f_a_proj, w.b_proj,
                                                          w.g_proj if cfg.use_full_rank_gate else w.g_a_proj))
    u_N3C = jnp.stack([q, k, v], 1).astype(dt)
    beta_NH = jax.nn.sigmoid(b)
    f_NC = linear(fa.astype(dt), w.f_b_proj, tp)
    z_NC = g if cfg.use_full_rank_gate else linear(g.astype(dt), w.g_b_proj, tp)
    return u_N3C, f_NC, beta_NH, z_NC


def core_weights(w: KDAWeights) -> CoreWeights:
    """The small weights the decode core reads; the conv taps as [3, C, K] fp32: stacked at load in the serving
    layout (`conv1d`), else here (in the step: a kernel of its own every step, measured 1.4 us per KDA layer)."""
    if w.conv1d is not None:
        conv = w.conv1d[:, :, 0]
    else:
        conv = jnp.stack([w.q_conv1d[:, 0], w.k_conv1d[:, 0], w.v_conv1d[:, 0]], 0)
    return CoreWeights(conv_3CK=conv.astype(F32), dt_bias_C=w.dt_bias, A_log_H=w.A_log, o_norm_K=w.o_norm)


def kda_prefill(cfg: KimiK3Config, w: KDAWeights, x_BTD: jax.Array, conv_B3CW: jax.Array, state_BHKV: jax.Array,
                valid_BT: jax.Array, tp: TP | str | None, chunk: int = 64, pos_B: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """KDA over T tokens per row (prefill): the same function as T `kda_step`s.

    `valid_BT` marks real tokens; the invalid ones of a row must come first (left padding): they
    leave the conv window and the state as they were (their projections are zeroed, their β and g
    are 0), exactly as a pad step of `kda_step` does on a fresh cache.  T must be a multiple of
    min(chunk, T).  Returns (out_BTD fp32 summed over TP, new conv_B3CW, new state_BHKV).  `pos_B` [B] int32, each
    row's position of the chunk's first valid token (the cache's length), is read where the conv cache is the ring.
    """
    B, T, D = x_BTD.shape
    pos_B = ring_positions(cfg, conv_B3CW, pos_B)
    older = conv_B3CW if pos_B is None else ring_window(conv_B3CW, pos_B)
    Kd, W = cfg.kda_head_dim, older.shape[-1]
    dt = x_BTD.dtype
    x = x_BTD.reshape(B * T, D)
    keep = valid_BT.astype(bool)
    # -- projections; the short causal conv over [conv state | chunk] (pads zeroed: a fresh state's zeros)
    u, f, beta, z = projections(cfg, w, x, tp)
    u_BT3C = jnp.where(keep[..., None, None], u.reshape(B, T, 3, -1), jnp.zeros((), dt))
    X = jnp.concatenate([jnp.moveaxis(older, -1, 1), u_BT3C], axis=1).astype(F32)  # [B, W+T, 3, C]
    w_3CK = core_weights(w).conv_3CK
    y = jax.nn.silu(sum(X[:, i:i + T] * w_3CK[None, None, :, :, i] for i in range(W + 1)))  # [B, T, 3, C]
    if pos_B is None:
        new_conv = jnp.moveaxis(X[:, T:], 1, -1).astype(conv_B3CW.dtype)
    else:  # the last K entries, positions end-K .. end-1, into the ring; end = pos + the valid tokens
        end_B = pos_B.astype(jnp.int32) + keep.sum(-1, dtype=jnp.int32)
        new_conv = ring_place(jnp.moveaxis(X[:, T - 1:], 1, -1), end_B).astype(conv_B3CW.dtype)
    q, k, v = (y[:, :, j].reshape(B, T, -1, Kd) for j in range(3))
    q = l2norm(q) * Kd ** -0.5
    k = l2norm(k)
    # -- gates (0 decay and β = 0 on pads: the state passes through)
    f = (f + w.dt_bias.astype(F32)).reshape(B, T, -1, Kd)
    g = jnp.where(keep[..., None, None], kda_gate(f, w.A_log, cfg.gate_lower_bound), 0.0)
    beta = jnp.where(keep[..., None], beta.reshape(B, T, -1), 0.0)
    # the gated delta rule over the chunk: kernels.kda_prefill (its reference is the per-chunk scan form)
    o, S = kernels.call("kda_prefill", *(jnp.moveaxis(a, 1, 2) for a in (q, k, v, g, beta)), state_BHKV, chunk=chunk,
                        mode=kernel_mode(tp))
    o_BTHV = jnp.moveaxis(o, 2, 1)
    # -- output gate, per-head norm, row-parallel o_proj
    o_BTHV = gated_rms_norm(o_BTHV, w.o_norm, z.reshape(o_BTHV.shape), cfg.rms_norm_eps)
    out = psum(linear(o_BTHV.reshape(B * T, -1).astype(dt), w.o_proj, tp), tp)
    return out.reshape(B, T, -1), new_conv, S
