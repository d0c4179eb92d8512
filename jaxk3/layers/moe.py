"""Dense GLU MLP (layer 0, shared experts) and the MoE block (docs/SPEC.md §3.5, §3.6).

    MLP(x)  = W_down · act(W_gate x, W_up x)            act: SiTU-GLU (K3) or SiLU-GLU
    logits  = W_router x  (fp32);  s = sigmoid(logits)
    I       = top_k(s + e_score_correction_bias)         the bias only selects (grouped top-k when n_group > 1)
    w_e     = s[e] / Σ_I s  (moe_renormalize)  · routed_scaling_factor
    K3 (latent):   z = W_lat_down x;  y = Σ_I w_e W2_e act(W1_e z, W3_e z)
                   y_rout = W_lat_up · RMSNorm(y; routed_expert_norm)
    Kimi-Linear:   y_rout = Σ_I w_e W2_e act(W1_e x, W3_e x)
    MoE(x)  = y_rout + MLP_shared(x)                      shared experts see the full x

TP (docs/SPEC.md §4): gate/up and W1/W3 are column-parallel over the intermediate, down/W2 row-parallel;
the router and the latent norm are replicated.  The latent projections follow `shard_latent`:
replicated (stock vLLM), or split (`routed_expert_down_proj` by its L output rows, z rebuilt with one
padded gather; `routed_expert_up_proj` by its L input columns, its partial summed with the shared
experts' partial in one psum).  K3 psums the experts' latent partial (before its RMSNorm) and the
rest separately, as vLLM does; Kimi-Linear sums both partials first and psums once.  Only the
selected experts run; their weights are read in place (see experts_partial).

Routed experts are dense (the model dtype) or MXFP4 (`cfg.experts_format`): packed E2M1 nibbles and
E8M0 scales as K3 ships them (jaxk3.mxfp4), dequantised where they are used (`expert_rows`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax.sharding import PartitionSpec as P

from jaxk3 import _compat, collectives, kernels
from jaxk3.config import MXFP4_GROUP, KimiK3Config
from jaxk3.kernels import moe_experts
from jaxk3.kernels.moe_experts import (MXFP4, SharedMLP, act, compute_dtype, dequantize,  # noqa: F401
                                       e8m0_scales, expert_rows, experts_partial, f16_exact,
                                       with_f16)
from jaxk3.kernels.rms_norm import rms_norm
from jaxk3.kernels.router import select_experts
from jaxk3.layers.common import F32, TP, Normed, as_tp, kernel_mode, linear, psum, split, value
from jaxk3.params import COL, LATENT, LATENT_ROW, REP, ROW, Fuse, Param, weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLPWeights:
    """HF `mlp.<field>.weight` (layer 0) or `block_sparse_moe.shared_experts.<field>.weight`."""
    gate_proj: jax.Array | None  # [I, D]  column-parallel
    up_proj: jax.Array | None  # [I, D]  column-parallel
    down_proj: jax.Array  # [D, I]  row-parallel
    # the serving layout (params.Fuse, made at load): per rank [gate | up] rows
    gate_up_proj: jax.Array | None = None

    FUSE = (Fuse("gate_up_proj", ("gate_proj", "up_proj")),)


def mlp_abstract(prefixes: str | tuple[str, ...], hidden: int, intermediate: int,
                 group: str = "mlp_and_shared_experts") -> MLPWeights:
    """A GLU MLP's weights under `prefixes` (the first is the hub spelling; transformers'
    `save_pretrained` writes layer 0's dense MLP as `block_sparse_moe.*`, so that is an alternate)."""
    D, I = hidden, intermediate
    return MLPWeights(gate_proj=weight((I, D), prefixes, "gate_proj", spec=COL, group=group),
                      up_proj=weight((I, D), prefixes, "up_proj", spec=COL, group=group),
                      down_proj=weight((D, I), prefixes, "down_proj", spec=ROW, group=group))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MoEWeights:
    """HF `model.layers.{l}.block_sparse_moe.*` (names in the comments)."""
    gate: jax.Array  # [E, D]       gate.weight, replicated
    e_score_correction_bias: jax.Array  # [E] fp32 gate.e_score_correction_bias
    experts_w1: jax.Array | MXFP4 | None  # [E, I, L]    experts.{e}.w1.weight stacked (gate), column over I
    experts_w2: jax.Array | MXFP4  # [E, L, I]    experts.{e}.w2.weight stacked (down), row over I
    experts_w3: jax.Array | MXFP4 | None  # [E, I, L]    experts.{e}.w3.weight stacked (up)
    shared_experts: MLPWeights | None = None
    routed_expert_down_proj: jax.Array | None = None  # [L, D]  LATENT: rows split or replicated (K3)
    routed_expert_norm: jax.Array | None = None  # [L]  replicated
    routed_expert_up_proj: jax.Array | None = None  # [D, L]  LATENT_ROW: columns split or replicated
    # the serving layout (params.Fuse, made at load): per rank [w1 | w3] along the intermediate axis
    experts_w13: jax.Array | MXFP4 | None = None  # [E, 2I, L]

    FUSE = (Fuse("experts_w13", ("experts_w1", "experts_w3"), axis=1),)


def moe_abstract(cfg: KimiK3Config, prefix: str) -> MoEWeights:
    """The MoE block's weights (`prefix` = `model.layers.{l}.block_sparse_moe.`), declared once."""
    D, E, I, L = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_hidden

    def experts(i: int, shape: tuple[int, int], spec) -> Param | MXFP4:
        name = f"{prefix}experts.{{e}}.w{i}.weight"
        if cfg.experts_format == "dense":
            return Param((E, *shape), (name,), spec, group="moe_experts", source="experts", ckpt_shape=shape)
        (O, In), G = shape, MXFP4_GROUP

        def part(suffix: str, cols: int, init: str) -> Param:
            return Param((E, O, cols), (f"{name}_{suffix}",), spec, dtype="uint8", init=init, group="moe_experts",
                         source="experts", ckpt_shape=(O, cols))
        return MXFP4(packed=part("packed", In // 2, "e2m1"), scale=part("scale", In // G, "e8m0"), f16=cfg.experts_f16)

    out = dict(gate=weight((E, D), prefix, "gate", spec=REP, group="moe_other"),
               e_score_correction_bias=weight((E,), prefix, "gate.e_score_correction_bias", spec=REP,
                                              dtype="fp32", init="bias", group="moe_other"),
               experts_w1=experts(1, (I, L), P(None, "tp", None)), experts_w2=experts(2, (L, I), P(None, None, "tp")),
               experts_w3=experts(3, (I, L), P(None, "tp", None)))
    if cfg.num_shared_experts:
        out["shared_experts"] = mlp_abstract(prefix + "shared_experts.", D, cfg.shared_intermediate_size)
    if cfg.routed_expert_hidden_size is not None:
        out.update(routed_expert_down_proj=weight((L, D), prefix, "routed_expert_down_proj", spec=LATENT,
                                                  group="moe_latent"),
                   routed_expert_norm=weight((L,), prefix, "routed_expert_norm", spec=REP, init="norm", group="moe_other"),
                   routed_expert_up_proj=weight((D, L), prefix, "routed_expert_up_proj", spec=LATENT_ROW,
                                                group="moe_latent"))
    return MoEWeights(**out)


def mlp_partial(cfg: KimiK3Config, w: MLPWeights, x_BD: jax.Array, tp: TP | str | None = None) -> jax.Array:
    """Row-parallel partial of the GLU MLP, fp32 [B, D] (sum over TP ranks = MLP(x)); gate and up as
    one GEMV in the serving layout."""
    if w.gate_up_proj is not None:
        a_BI, b_BI = split(linear(x_BD, w.gate_up_proj, tp), (w.down_proj.shape[1],) * 2)
    else:
        a_BI, b_BI = linear(x_BD, w.gate_proj, tp), linear(x_BD, w.up_proj, tp)
    return linear(act(cfg, a_BI, b_BI).astype(x_BD.dtype), w.down_proj, tp)


def mlp(cfg: KimiK3Config, w: MLPWeights, x_BD: jax.Array, tp: TP | str | None) -> jax.Array:
    """Dense MLP, fp32 out, summed over TP."""
    return psum(mlp_partial(cfg, w, x_BD, tp), tp)


def route(cfg: KimiK3Config, gate_ED: jax.Array, bias_E: jax.Array, x_BD: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
    """Sigmoid noaux_tc router in fp32: (weights_Bk with rsf applied, ids_Bk)."""
    return select_experts(cfg, router_logits(gate_ED, x_BD), bias_E)


def router_logits(gate_ED: jax.Array, x_BD: jax.Array) -> jax.Array:
    """The router's fp32 logits [B, E]."""
    return jnp.einsum("bd,ed->be", x_BD.astype(F32), gate_ED.astype(F32))


def _experts_decode(cfg, w, z_BL, w_Bk, ids_Bk, mode: str) -> jax.Array:
    """`experts_partial`, through the `moe_experts` device kernel where `mode` and the platform allow.
    The kernel is for decode rows (<= moe_experts.MAX_B) of bf16 or MXFP4 experts: with kernels="on" larger
    batches and other dtypes keep XLA's path (as `linear` does for the GEMV), not an error."""
    if mode == "on" and (z_BL.shape[0] > moe_experts.MAX_B or (
            not isinstance(w.experts_w2, MXFP4) and w.experts_w2.dtype != jnp.bfloat16)):
        mode = "auto"
    return kernels.call("moe_experts", cfg, w, z_BL, w_Bk, ids_Bk, mode=mode)


def _shared_mlp(w: MoEWeights) -> SharedMLP | None:
    """The shared experts as the experts kernels take them (the serving layout's gate | up and down), or None
    (no shared experts, or the checkpoint layout's gate and up apart)."""
    s = w.shared_experts
    return None if s is None or s.gate_up_proj is None else SharedMLP(s.gate_up_proj, s.down_proj)


def _shared_in_kernel(cfg, w: MoEWeights, x_BD, w_Bk, ids_Bk, mode: str) -> SharedMLP | None:
    """The shared experts as the `moe_experts` kernel takes them beside the routed ones (their gate | up and
    down in its two kernels: no kernels of their own), where the routed experts read the same input and the
    kernel runs; else None (the shared experts go through `mlp_partial`)."""
    shared = _shared_mlp(w)
    if shared is None:
        return None
    how = kernels.explain("moe_experts", cfg, w, x_BD, w_Bk, ids_Bk, shared=shared, mode=mode)
    return shared if how.startswith("device") else None


def _experts_routed(cfg, w: MoEWeights, x_BD: jax.Array, logits_BE: jax.Array, mode: str, tp,
                    residual: jax.Array | None = None) -> tuple[jax.Array, bool] | None:
    """(the routed and shared experts' partial of one token, False) with the router's selection inside the
    `moe_experts` kernels (`moe_experts_routed`: no selection kernels of XLA's in the step), where that form runs; else
    None.  The shared experts go into the kernels too where they can (their gate | up in the serving layout, the routed
    experts' shapes), else through `mlp_partial`.  With `residual` (one rank) and the shared experts in the kernels:
    (bf16(residual + that partial), True), the kernels adding it."""
    args = (cfg, w, x_BD, logits_BE, w.e_score_correction_bias)
    shared = _shared_mlp(w)
    if shared is not None and kernels.explain("moe_experts_routed", *args, shared=shared,
                                              mode=mode).startswith("device"):
        return kernels.call("moe_experts_routed", *args, shared=shared, mode=mode, residual=residual), residual is not None
    if not kernels.explain("moe_experts_routed", *args, mode=mode).startswith("device"):
        return None
    out = kernels.call("moe_experts_routed", *args, mode=mode)
    s = w.shared_experts
    return (out if s is None else out + mlp_partial(cfg, s, x_BD, tp)), False


def _one_rank(tp) -> bool:
    """Whether this block's sum is this rank's alone (no TP axis, or one of size 1): no psum after the experts."""
    tp = as_tp(tp)
    return tp is None or (_compat.axis_bound(tp.axis) and lax.axis_size(tp.axis) == 1)


def _experts_prefill(cfg, w, z_NL, w_Nk, ids_Nk, mode: str) -> jax.Array:
    """`experts_partial` for many tokens: the `moe_grouped` kernel (grouped GEMMs over the pairs sorted by
    expert) where `mode` and the platform allow, else the dense form (jaxk3.kernels.moe_grouped)."""
    return kernels.call("moe_grouped", cfg, w, z_NL, w_Nk, ids_Nk, mode=mode)


def _route_normed(cfg, w: MoEWeights, x: Normed, mode: str) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """(weights_Bk, ids_Bk, the normed input) of a decode MoE block whose input comes un-normed, where both
    kernels run: the logits by the GEMV that norms x in its prologue (`gemv_norm`: bf16 products summed in
    fp32, `router_logits`' arithmetic), the selection and the experts' normed row by the router kernel.
    None where either does not (the caller norms x and routes as before)."""
    E = w.gate.shape[0]
    kw = dict(norm_w=x.w, eps=x.eps)
    if w.gate.dtype != x.dtype or not kernels.explain("gemv_norm", x.h, w.gate, mode=mode, **kw).startswith("device"):
        return None
    logits = jax.ShapeDtypeStruct((x.shape[0], E), F32)
    if not kernels.explain("router_topk", cfg, logits, w.e_score_correction_bias, x_BD=x.h, mode=mode,
                           **kw).startswith("device"):
        return None
    return kernels.call("router_topk", cfg, kernels.call("gemv_norm", x.h, w.gate, mode=mode, **kw),
                        w.e_score_correction_bias, x_BD=x.h, mode=mode, **kw)


# K3's latent MoE at decode: the routed experts' latent output y (fp32, the experts' partial sums added) normed in the
# prologue of the up projection's GEMV (`gemv_norm` on the fp32 row: the same rounding to bf16 after the norm) instead
# of by XLA in two kernels before XLA's GEMM, which streamed the up projection at 1.9 TB/s on an H100.  Taken at one
# row, where it was timed faster: K3 layers 11-14 packed B = 1 on an H100, 3175.2 us against 3224.9 / 3220.9 without
# it in the same call; at B = 8 it was slower (4249.8 against 4116.0 / 4157.2), so B > 1 keeps XLA's path
# (docs/PERF.md, twenty-ninth session).  The switch stays for A/B calls (`step_with_kernel.py
# jaxk3.layers.moe:LATENT_NORM_IN_UP=0`).
LATENT_NORM_IN_UP = True


def _up_normed(cfg: KimiK3Config, w: MoEWeights, y_BL: jax.Array, mode: str) -> jax.Array | None:
    """W_lat_up · RMSNorm(y; routed_expert_norm) [1, D] fp32 from the un-normed fp32 latent row y [1, L], the norm
    in the GEMV's prologue, where LATENT_NORM_IN_UP is on, there is one row, the kernel mode is not "off" and the
    kernel runs on this platform and fits; else None (the caller norms y with XLA)."""
    if not (LATENT_NORM_IN_UP and cfg.latent_moe_use_norm) or y_BL.ndim != 2 or y_BL.shape[0] != 1 or mode == "off":
        return None
    args = (y_BL, w.routed_expert_up_proj)
    # "on" at this one call: gemv_norm's own auto table covers the blocks' bf16 input rows, not this fp32 one
    kw = dict(norm_w=w.routed_expert_norm, eps=cfg.rms_norm_eps, mode="on")
    if not kernels.explain("gemv_norm", *args, **kw).startswith("device"):
        return None
    return kernels.call("gemv_norm", *args, **kw)


def moe(cfg: KimiK3Config, w: MoEWeights, x_BD: jax.Array | Normed, tp: TP | str | None,
        grouped: bool = False, residual: jax.Array | None = None) -> jax.Array:
    """The MoE block on B tokens: fp32 [B, D], summed over TP.  `grouped` (prefill): the experts
    over all tokens at once (dense GEMMs over the local experts, in token blocks) instead of
    per-token GEMVs (decode): jaxk3.kernels.moe_grouped has the forms (dense GEMMs over the local
    experts in token blocks, today's path; the grouped-GEMM kernel; `experts_grouped`, ragged_dot).
    A `Normed` input (decode) is normed by the routing kernels (`_route_normed`) where they run; at decode the
    Kimi-Linear experts may also take the router's logits and select inside their kernels (`_experts_routed`).
    `residual` (decode: the residual stream h [B, D] this block adds to): the new stream bf16(h + out) instead of out,
    added in the experts' call where one rank holds the whole sum (by kernel 2 itself at one token with bf16 experts,
    `moe_experts.RESIDUAL_IN_DOWN`; else `moe_experts.add_residual` after the kernels), else after the psum: each
    `attn_res.ffn_done`'s float32 add and bf16 rounding of the experts' sum."""
    dt = x_BD.dtype
    mode = kernel_mode(tp)
    fold = residual if residual is not None and not grouped and _one_rank(tp) else None
    done = functools.partial(moe_experts.add_residual, residual=residual)  # (after the psum)

    experts = functools.partial(_experts_prefill if grouped else _experts_decode, mode=mode)
    routed = _route_normed(cfg, w, x_BD, mode) if isinstance(x_BD, Normed) else None
    if routed is not None:
        w_Bk, ids_Bk, x_BD = routed
    else:
        x_BD = value(x_BD)
        logits_BE = router_logits(w.gate, x_BD)
        if w.routed_expert_down_proj is None and not grouped:  # Kimi-Linear decode: the selection in the kernels?
            got = _experts_routed(cfg, w, x_BD, logits_BE, mode, tp, fold)
            if got is not None:
                return got[0] if got[1] else done(psum(got[0], tp))
        w_Bk, ids_Bk = kernels.call("router_topk", cfg, logits_BE, w.e_score_correction_bias, mode=mode)
    if w.routed_expert_down_proj is None and not grouped:  # Kimi-Linear decode: shared experts in the kernel?
        fused = _shared_in_kernel(cfg, w, x_BD, w_Bk, ids_Bk, mode)
        if fused is not None:
            out = kernels.call("moe_experts", cfg, w, x_BD, w_Bk, ids_Bk, shared=fused, mode=mode, residual=fold)
            return out if fold is not None else done(psum(out, tp))
    shared_BD = mlp_partial(cfg, w.shared_experts, x_BD, tp) if w.shared_experts is not None else 0.0
    if w.routed_expert_down_proj is None:  # Kimi-Linear: experts on x, one psum for both partials
        return done(psum(experts(cfg, w, x_BD, w_Bk, ids_Bk) + shared_BD, tp))
    L, tp = cfg.moe_hidden, as_tp(tp)
    sharded = w.routed_expert_down_proj.shape[0] != L  # shard_latent: this rank holds L/tp rows
    if sharded != (w.routed_expert_up_proj.shape[1] != L):
        raise ValueError(f"routed_expert_down_proj {w.routed_expert_down_proj.shape} and routed_expert_up_proj "
                         f"{w.routed_expert_up_proj.shape} (per rank): both split over TP (shard_latent) or both whole")
    z_BL = linear(x_BD, w.routed_expert_down_proj, tp).astype(dt)
    if sharded:  # one gather rebuilds z [B, L] from every rank's L/tp features
        z_BL = collectives.padded_all_gather(z_BL, tp.axis, axis=-1, tiled=True, impl=tp.gather)
    y_BL = psum(experts(cfg, w, z_BL, w_Bk, ids_Bk), tp)
    up = None if sharded or grouped else _up_normed(cfg, w, y_BL, mode)
    if up is not None:  # the latent norm in the up projection's prologue
        return done(up + psum(shared_BD, tp))
    if cfg.latent_moe_use_norm:
        y_BL = rms_norm(y_BL, w.routed_expert_norm, cfg.rms_norm_eps)
    y_BL = y_BL.astype(dt)
    if not sharded:
        return done(linear(y_BL, w.routed_expert_up_proj, tp) + psum(shared_BD, tp))
    n = w.routed_expert_up_proj.shape[1]  # this rank's L/tp input columns of the up projection
    y_local = lax.dynamic_slice_in_dim(y_BL, lax.axis_index(tp.axis) * n, n, axis=-1)
    return done(psum(linear(y_local, w.routed_expert_up_proj, tp) + shared_BD, tp))
