"""Gated NoPE MLA over a latent cache, absorbed decode (docs/SPEC.md §3.4).

    c_q          = RMSNorm(W_qa x; q_a_layernorm)              (K3 q-LoRA)
    q            = (W_qb c_q | W_q x).view(H, nope+rope) = [q_nope | q_pe]   (no RoPE anywhere)
    [c_kv | k_pe]= W_kva x;  c_kv ← RMSNorm(c_kv; kv_a_layernorm)
    cache[t]     = [c_kv | k_pe]        R = kv_lora + rope wide, one latent "head" shared by all heads,
                                        written BEFORE attention (the token attends to itself)
    W_kvb.view(H, nope+v, kv_lora) = [W_UK ; W_UV]
    ql_h         = W_UK[h]ᵀ q_nope_h                                   (absorbed query, kv_lora wide)
    score_t      = (ql_h·c_kv_t + q_pe_h·k_pe_t) · (nope+rope)^-½
    o_h          = W_UV[h] Σ_t softmax(score)_t c_kv_t
    out          = W_o · (concat_h o_h ⊙ sigmoid(W_g x))              gate: K3 only; row-parallel → psum

Latent projection under TP (`shard_latent=True`): `q_a_proj` and `kv_a_proj_with_mqa` are each
split by output rows over TP; a rank computes its rows of both, concatenated, and ONE
`collectives.padded_all_gather` along features rebuilds the full `[c_q | c_kv | k_pe]` on every rank.
With `shard_latent=False` both weights are replicated (stock vLLM) and no gather is needed.
Kimi-Linear has no q-LoRA: its `q_proj` is column-parallel by heads; only `kv_a` is the latent.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxk3 import collectives, kernels
from jaxk3.config import KimiK3Config
from jaxk3.kernels import gemv, mla_prep
from jaxk3.kernels.rms_norm import rms_norm
from jaxk3.layers.common import F32, TP, as_tp, kernel_mode, linear, psum, split
from jaxk3.params import COL, LATENT, REP, ROW, Buffer, Fuse, weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLAWeights:
    """HF `model.layers.{l}.self_attn.<field>.weight`; shapes global."""
    kv_a_proj_with_mqa: jax.Array  # [R, D]  rows [c_kv | k_pe]   latent (sharded by rows or replicated)
    kv_a_layernorm: jax.Array  # [kv_lora]
    kv_b_proj: jax.Array  # [H*(nope+v), kv_lora]  per head rows [k_nope | v]   column-parallel
    o_proj: jax.Array  # [D, H*v]   row-parallel
    q_a_proj: jax.Array | None = None  # [q_lora, D]   latent (K3)
    q_a_layernorm: jax.Array | None = None  # [q_lora]
    q_b_proj: jax.Array | None = None  # [H*(nope+rope), q_lora]   column-parallel
    q_proj: jax.Array | None = None  # [H*(nope+rope), D]   Kimi-Linear, column-parallel
    g_proj: jax.Array | None = None  # [H*v, D]   K3 output gate, column-parallel
    # the serving layout (params.Fuse, made at load): per rank [latent rows | q_proj | g_proj] rows
    in_proj: jax.Array | None = None

    FUSE = tuple(Fuse("in_proj", m) for m in (("q_a_proj", "kv_a_proj_with_mqa", "g_proj"),
                                              ("q_a_proj", "kv_a_proj_with_mqa"),
                                              ("kv_a_proj_with_mqa", "q_proj", "g_proj"),
                                              ("kv_a_proj_with_mqa", "q_proj")))


def abstract(cfg: KimiK3Config, prefix: str) -> MLAWeights:
    """The weights of one MLA layer (`prefix` = `model.layers.{l}.self_attn.`), declared once."""
    D, H, n, r, v, R = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim, cfg.kv_lora_rank)

    def w(field, shape, spec, group="mla_other", **kw):
        return weight(shape, prefix, field, spec=spec, group=group, **kw)

    out = dict(kv_a_proj_with_mqa=w("kv_a_proj_with_mqa", (R + r, D), LATENT, group="mla_latent"),
               kv_a_layernorm=w("kv_a_layernorm", (R,), REP, init="norm"),
               kv_b_proj=w("kv_b_proj", (H * (n + v), R), COL), o_proj=w("o_proj", (D, H * v), ROW))
    if cfg.q_lora_rank is not None:
        Q = cfg.q_lora_rank
        out.update(q_a_proj=w("q_a_proj", (Q, D), LATENT, group="mla_latent"),
                   q_a_layernorm=w("q_a_layernorm", (Q,), REP, init="norm"),
                   q_b_proj=w("q_b_proj", (H * (n + r), Q), COL))
    else:
        out["q_proj"] = w("q_proj", (H * (n + r), D), COL)
    if cfg.mla_use_output_gate:
        out["g_proj"] = w("g_proj", (H * v, D), COL)
    return MLAWeights(**out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLACache:
    """Decode state of one MLA layer for B rows: the latent cache, replicated over TP (MQA)."""
    kv: jax.Array  # [B, S, R]  [c_kv | k_pe] per cached position, activation dtype


def cache_abstract(cfg: KimiK3Config, batch: int, max_len: int) -> MLACache:
    return MLACache(kv=Buffer((batch, max_len, cfg.latent_dim), "compute"))


def input_projections(cfg: KimiK3Config, w: MLAWeights, x_BD: jax.Array, tp: TP | str | None,
                      shard_latent: bool, gather: str | None = None, raw: list | None = None
                      ) -> tuple[jax.Array | None, jax.Array, jax.Array | None, jax.Array | None]:
    """Every projection of the layer's input x: (c_q_BQ or None (K3), ckv_BR = [c_kv | k_pe], both full
    vectors in the activation dtype; q_BF (Kimi-Linear's q_proj) or None; g_BF (K3's output-gate
    logits) or None; the last two fp32 and local).  In the serving layout one GEMV (`in_proj`) computes
    them all; in the checkpoint layout one GEMV per weight.  Under `shard_latent` each rank computes
    its rows of the latent projections and one gather rebuilds the full vectors.  `raw` (a list): where
    the serving layout's GEMV output holds the full [c_kv | k_pe] (no gather, or a group of one), it gets
    (y fp32 [B, X], ckv's offset, q's offset or None), so that a kernel can read them in place (`mla_prep`;
    with `mla_prep.PARTIALS` the GEMV's partial sums [S, B, X] instead, which the kernel adds)."""
    dt = x_BD.dtype
    tp = as_tp(tp)
    n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    h = w.kv_b_proj.shape[0] // (n + v)  # local heads
    split_latent = shard_latent and tp is not None
    parts = [w.q_a_proj] if w.q_a_proj is not None else []
    parts.append(w.kv_a_proj_with_mqa)
    if w.in_proj is not None:
        rows = cfg.num_attention_heads // h if split_latent else 1  # the latent projections' row split
        lat = ([cfg.q_lora_rank // rows] if cfg.q_lora_rank is not None else []) + [cfg.latent_dim // rows]
        rest = ([h * (n + r)] if cfg.q_lora_rank is None else []) + ([h * v] if cfg.mla_use_output_gate else [])
        direct = raw is not None and (rows == 1 or not split_latent)
        if direct and mla_prep.PARTIALS and x_BD.shape[0] == 1:  # the GEMV's K splits left for mla_prep to add
            p_SBX = linear(x_BD, w.in_proj, tp, sums=True)
            y_BX = gemv.add_splits(p_SBX)
        else:
            y_BX = p_SBX = linear(x_BD, w.in_proj, tp)
        outs = split(y_BX, lat + rest)
        local = [o.astype(dt) for o in outs[:len(lat)]]
        if direct:
            raw.append((p_SBX, sum(lat) - cfg.latent_dim, sum(lat) if cfg.q_lora_rank is None else None))
        q_BF = outs[len(lat)] if cfg.q_lora_rank is None else None
        g_BF = outs[-1] if cfg.mla_use_output_gate else None
        widths = lat
    else:
        local = [linear(x_BD, p, tp).astype(dt) for p in parts]
        q_BF = linear(x_BD, w.q_proj, tp) if w.q_proj is not None else None
        g_BF = linear(x_BD, w.g_proj, tp) if cfg.mla_use_output_gate else None
        widths = [p.shape[0] for p in parts]
    if not split_latent:
        return (local[0] if len(local) == 2 else None), local[-1], q_BF, g_BF
    # each rank holds rows [r·n/tp, (r+1)·n/tp) of each latent weight: one gather of the concatenation
    full_BTX = collectives.padded_all_gather(jnp.concatenate(local, -1), tp.axis, axis=-1, tiled=True,
                                             impl=gather or tp.gather)
    B = x_BD.shape[0]
    full_BTX = full_BTX.reshape(B, -1, sum(widths))  # [B, tp, local widths]
    n_tp = full_BTX.shape[1]
    outs = [o.reshape(B, n_tp * k) for o, k in zip(split(full_BTX, widths), widths)]
    return (outs[0] if len(outs) == 2 else None), outs[-1], q_BF, g_BF


def mla_step(cfg: KimiK3Config, w: MLAWeights, x_BD: jax.Array, kv_BSR: jax.Array, length_B: jax.Array,
             valid_B: jax.Array, tp: TP | str | None, shard_latent: bool = True, gather: str | None = None,
             ) -> tuple[jax.Array, jax.Array]:
    """One MLA decode step.  `length_B` = tokens already cached per row (this token's slot).

    Returns (out_BD fp32 summed over TP, new kv_BSR).  Rows with `valid_B == False` are not written.
    """
    B, S = x_BD.shape[0], kv_BSR.shape[1]
    dt = x_BD.dtype
    n, r, v, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    raw: list = []
    cq_BQ, ckv_BR, q_BF, g_BF = input_projections(cfg, w, x_BD, tp, shard_latent, gather, raw)
    if cq_BQ is not None:
        q_BF = linear(rms_norm(cq_BQ, w.q_a_layernorm, cfg.rms_norm_eps).astype(dt), w.q_b_proj, tp)
    # -- the absorbed query ql_h = W_UK[h]ᵀ q_nope_h, q_pe, and the new latent written at slot length_B (pad rows keep
    # the old value): one kernel where `mla_prep` runs, reading the GEMV's output in place (jaxk3.kernels.mla_prep)
    wkvb = w.kv_b_proj.reshape(-1, n + v, R)
    h = wkvb.shape[0]
    mode = kernel_mode(tp)
    spec = (jax.ShapeDtypeStruct((B, h, R), F32), jax.ShapeDtypeStruct((B, h, r), F32), kv_BSR, length_B,
            (n + r) ** -0.5)
    uv = kernels.explain("mla_decode_uv", *spec, wkvb, n, mode=mode).startswith("device")  # merge + W_UV: one kernel
    on_device = uv or kernels.explain("mla_decode", *spec, mode=mode).startswith("device")
    y_BX, kv_off, q_off = raw[0] if raw else (None, 0, None)
    q_src, q_off = (y_BX, q_off) if q_off is not None else (q_BF, 0)
    kv_src = y_BX if y_BX is not None else ckv_BR
    prep = (q_src, q_off, kv_src, kv_off, wkvb, n, w.kv_a_layernorm, cfg.rms_norm_eps, kv_BSR, length_B, valid_B, dt)
    # the attention kernel rounds ql and q_pe to the cache's bf16: the prep kernel hands them over as such (no cast
    # kernel between the two); XLA's path keeps them fp32 (its program as before the kernel: an einsum with a bf16
    # output may lower otherwise on a GPU)
    bf16_out = on_device and kernels.explain("mla_prep", *prep, mode=mode).startswith("device")
    ql_BHR, qpe_BHP, kv_BSR = kernels.call("mla_prep", *prep, out_dtype=kv_BSR.dtype if bf16_out else F32, mode=mode)
    # -- absorbed attention over slots t <= length_B
    att = (ql_BHR, qpe_BHP, kv_BSR, length_B, (n + r) ** -0.5)
    if uv:
        o_BHV = kernels.call("mla_decode_uv", *att, wkvb, n, mode=mode)
    else:
        olat_BHR = kernels.call("mla_decode", *att, mode=mode)
        o_BHV = jnp.einsum("bhr,hvr->bhv", olat_BHR, wkvb[:, n:].astype(F32))
    o_BF = o_BHV.reshape(B, -1)
    if g_BF is not None:
        o_BF = o_BF * jax.nn.sigmoid(g_BF)
    return psum(linear(o_BF.astype(dt), w.o_proj, tp), tp), kv_BSR


def mla_prefill(cfg: KimiK3Config, w: MLAWeights, x_BTD: jax.Array, kv_BSR: jax.Array, length_B: jax.Array,
                valid_BT: jax.Array, tp: TP | str | None, shard_latent: bool = True, gather: str | None = None,
                ) -> tuple[jax.Array, jax.Array]:
    """MLA over T tokens per row (prefill): causal attention over the cached prefix and the chunk.

    A row's valid tokens are written to the latent cache at slots length_B, length_B + 1, …, in order
    (invalid ones are not written); token t attends to every cache slot up to its own, as T
    `mla_step`s would.  Returns (out_BTD fp32 summed over TP, new kv_BSR)."""
    B, T, D = x_BTD.shape
    S = kv_BSR.shape[1]
    dt = x_BTD.dtype
    n, r, v, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    x = x_BTD.reshape(B * T, D)
    cq, ckv, q, g = input_projections(cfg, w, x, tp, shard_latent, gather)  # T rows per row: the prefill gather
    if cq is not None:
        q = linear(rms_norm(cq, w.q_a_layernorm, cfg.rms_norm_eps).astype(dt), w.q_b_proj, tp)
    q_BTHX = q.astype(dt).astype(F32).reshape(B, T, -1, n + r)
    entry = jnp.concatenate([rms_norm(ckv[:, :R], w.kv_a_layernorm, cfg.rms_norm_eps).astype(dt), ckv[:, R:]], -1)
    # -- write the valid tokens' latents at their slots (invalid ones: dropped, out of range)
    keep = valid_BT.astype(bool)
    slot_BT = length_B[:, None] + jnp.cumsum(keep, axis=1, dtype=length_B.dtype) - 1
    write_BT = jnp.where(keep, slot_BT, S)
    kv_BSR = kv_BSR.at[jnp.arange(B)[:, None], write_BT].set(entry.reshape(B, T, -1).astype(kv_BSR.dtype),
                                                             mode="drop")
    # -- absorbed causal attention: token t sees slots <= its own (a pad token sees slot 0: finite, unused)
    wkvb_HXR = w.kv_b_proj.reshape(-1, n + v, R).astype(F32)
    o = kernels.call("mla_prefill", q_BTHX[..., :n], q_BTHX[..., n:], kv_BSR, jnp.maximum(slot_BT, 0), wkvb_HXR,
                     (n + r) ** -0.5, mode=kernel_mode(tp))
    o_NF = o.reshape(B * T, -1)
    if g is not None:
        o_NF = o_NF * jax.nn.sigmoid(g)
    return psum(linear(o_NF.astype(dt), w.o_proj, tp), tp).reshape(B, T, -1), kv_BSR
