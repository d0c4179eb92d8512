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
the router and latent down/up/norm are replicated.  K3 psums the latent partial (before its
RMSNorm) and the shared partial separately, as vLLM does; Kimi-Linear sums both partials first and
psums once.  Only the selected experts run; their weights are read in place (see experts_partial).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jax.sharding import PartitionSpec as P

from jaxk3.config import KimiK3Config
from jaxk3.layers.common import F32, TP, glu, linear, psum
from jaxk3.layers.norm import rms_norm
from jaxk3.params import COL, REP, ROW, Param, weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLPWeights:
    """HF `mlp.<field>.weight` (layer 0) or `block_sparse_moe.shared_experts.<field>.weight`."""
    gate_proj: jax.Array  # [I, D]  column-parallel
    up_proj: jax.Array  # [I, D]  column-parallel
    down_proj: jax.Array  # [D, I]  row-parallel


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
    experts_w1: jax.Array  # [E, I, L]    experts.{e}.w1.weight stacked (gate), column over I
    experts_w2: jax.Array  # [E, L, I]    experts.{e}.w2.weight stacked (down), row over I
    experts_w3: jax.Array  # [E, I, L]    experts.{e}.w3.weight stacked (up)
    shared_experts: MLPWeights | None = None
    routed_expert_down_proj: jax.Array | None = None  # [L, D]  replicated (K3 latent)
    routed_expert_norm: jax.Array | None = None  # [L]
    routed_expert_up_proj: jax.Array | None = None  # [D, L]  replicated


def moe_abstract(cfg: KimiK3Config, prefix: str) -> MoEWeights:
    """The MoE block's weights (`prefix` = `model.layers.{l}.block_sparse_moe.`), declared once."""
    D, E, I, L = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_hidden

    def experts(i: int, shape: tuple[int, int], spec) -> Param:
        return Param((E, *shape), (f"{prefix}experts.{{e}}.w{i}.weight",), spec, group="moe_experts",
                     source="experts", ckpt_shape=shape)

    out = dict(gate=weight((E, D), prefix, "gate", spec=REP, group="moe_other"),
               e_score_correction_bias=weight((E,), prefix, "gate.e_score_correction_bias", spec=REP,
                                              dtype="fp32", init="bias", group="moe_other"),
               experts_w1=experts(1, (I, L), P(None, "tp", None)), experts_w2=experts(2, (L, I), P(None, None, "tp")),
               experts_w3=experts(3, (I, L), P(None, "tp", None)))
    if cfg.num_shared_experts:
        out["shared_experts"] = mlp_abstract(prefix + "shared_experts.", D, cfg.shared_intermediate_size)
    if cfg.routed_expert_hidden_size is not None:
        out.update(routed_expert_down_proj=weight((L, D), prefix, "routed_expert_down_proj", spec=REP, group="moe_other"),
                   routed_expert_norm=weight((L,), prefix, "routed_expert_norm", spec=REP, init="norm", group="moe_other"),
                   routed_expert_up_proj=weight((D, L), prefix, "routed_expert_up_proj", spec=REP, group="moe_other"))
    return MoEWeights(**out)


def _act(cfg: KimiK3Config, a: jax.Array, b: jax.Array) -> jax.Array:
    return glu(a, b, cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)


def mlp_partial(cfg: KimiK3Config, w: MLPWeights, x_BD: jax.Array) -> jax.Array:
    """Row-parallel partial of the GLU MLP, fp32 [B, D] (sum over TP ranks = MLP(x))."""
    h_BI = _act(cfg, linear(x_BD, w.gate_proj), linear(x_BD, w.up_proj))
    return linear(h_BI.astype(x_BD.dtype), w.down_proj)


def mlp(cfg: KimiK3Config, w: MLPWeights, x_BD: jax.Array, tp: TP | str | None) -> jax.Array:
    """Dense MLP, fp32 out, summed over TP."""
    return psum(mlp_partial(cfg, w, x_BD), tp)


def route(cfg: KimiK3Config, gate_ED: jax.Array, bias_E: jax.Array, x_BD: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
    """Sigmoid noaux_tc router in fp32: (weights_Bk with rsf applied, ids_Bk)."""
    logits_BE = jnp.einsum("bd,ed->be", x_BD.astype(F32), gate_ED.astype(F32))
    s_BE = jax.nn.sigmoid(logits_BE)
    sel_BE = s_BE + bias_E.astype(F32)
    G = cfg.num_expert_group
    if cfg.use_grouped_topk and G > 1:  # DeepSeek-V3 group limit: keep the topk_group groups with the best top-2 sums
        B, E = sel_BE.shape
        gs_BG = lax.top_k(sel_BE.reshape(B, G, E // G), 2)[0].sum(-1)
        _, gid_Bg = lax.top_k(gs_BG, cfg.topk_group)
        keep_BG = jnp.zeros((B, G), bool).at[jnp.arange(B)[:, None], gid_Bg].set(True)
        sel_BE = jnp.where(jnp.repeat(keep_BG, E // G, axis=1), sel_BE, -jnp.inf)
    _, ids_Bk = lax.top_k(sel_BE, cfg.num_experts_per_token)
    w_Bk = jnp.take_along_axis(s_BE, ids_Bk, axis=1)
    if cfg.moe_renormalize:
        w_Bk = w_Bk / (jnp.sum(w_Bk, axis=-1, keepdims=True) + 1e-20)
    return w_Bk * cfg.routed_scaling_factor, ids_Bk


def experts_partial(cfg: KimiK3Config, w: MoEWeights, z_BL: jax.Array, w_Bk: jax.Array, ids_Bk: jax.Array
                    ) -> jax.Array:
    """Σ_k w_k · W2_k act(W1_k z, W3_k z) over the local intermediate shard: fp32 [B, L] partial.

    Each GEMV is written as gather · multiply · sum so that XLA fuses the expert gather into the
    reduction and reads each selected expert's weights once.  As an einsum over `jnp.take(...)`
    the gather is materialised first (a [B, k, I, L] copy written and read again: measured on
    2x H200 as 4.2 GB of extra traffic per K3 decode step at B=1, docs/PERF.md)."""
    z = z_BL.astype(w.experts_w1.dtype).astype(F32)  # the experts see the compute dtype, as in vLLM

    def gemv(w_EOI: jax.Array, x_BkI: jax.Array) -> jax.Array:  # [B, k, O] = W[ids] @ x, fp32
        return jnp.sum(jnp.take(w_EOI, ids_Bk, axis=0).astype(F32) * x_BkI[:, :, None, :], axis=-1)

    zk = jnp.broadcast_to(z[:, None, :], (*ids_Bk.shape, z.shape[-1]))
    h1_BkI = gemv(w.experts_w1, zk)
    h3_BkI = gemv(w.experts_w3, zk)
    a_BkI = _act(cfg, h1_BkI, h3_BkI).astype(w.experts_w1.dtype).astype(F32)
    y_BkL = gemv(w.experts_w2, a_BkI)
    return jnp.einsum("bkl,bk->bl", y_BkL, w_Bk)


_RAGGED = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                       rhs_group_dimensions=[0])


def experts_grouped(cfg: KimiK3Config, w: MoEWeights, z_NL: jax.Array, w_Nk: jax.Array, ids_Nk: jax.Array
                    ) -> jax.Array:
    """`experts_partial` for many tokens (prefill): the N·k (token, expert) pairs sorted by expert and
    run as grouped GEMMs (`lax.ragged_dot_general`), so each expert's weights are read once per call
    whatever the number of tokens.  fp32 [N, L] partial over the local intermediate shard."""
    N, k = ids_Nk.shape
    E, dt = w.experts_w1.shape[0], w.experts_w1.dtype
    flat = ids_Nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = z_NL.astype(dt)[token]  # [N·k, L], grouped by expert

    def gemm(x, w_EOI):
        return lax.ragged_dot_general(x, w_EOI, sizes, _RAGGED, preferred_element_type=F32)

    a = _act(cfg, gemm(xs, w.experts_w1), gemm(xs, w.experts_w3)).astype(dt)
    y = gemm(a, w.experts_w2) * w_Nk.reshape(-1)[order][:, None]
    return jax.ops.segment_sum(y, token, num_segments=N)


def experts_dense(cfg: KimiK3Config, w: MoEWeights, z_NL: jax.Array, w_Nk: jax.Array, ids_Nk: jax.Array
                  ) -> jax.Array:
    """`experts_partial` for many tokens as dense GEMMs over every local expert, each token's
    unselected experts weighted 0 (their terms add exactly 0): E/k times the FLOPs of the exact
    grouped form, but plain batched matrix products.  Measured on an H200 (Kimi-Linear-48B dims,
    512 tokens, 64 experts): XLA's GPU `ragged_dot` took 6.0 ms per layer, far above this form's
    FLOPs.  Tokens go in blocks whose fp32 [n, E, I] activations fit DENSE_MOE_BYTES (lax.map)."""
    N, (E, I) = z_NL.shape[0], w.experts_w1.shape[:2]
    dt = w.experts_w1.dtype
    weights_NE = jnp.zeros((N, E), F32).at[jnp.arange(N)[:, None], ids_Nk].add(w_Nk.astype(F32))

    def block(args):
        z, weights = args
        z = z.astype(dt)
        h1 = jnp.einsum("nl,eil->nei", z, w.experts_w1, preferred_element_type=F32)
        h3 = jnp.einsum("nl,eil->nei", z, w.experts_w3, preferred_element_type=F32)
        a = _act(cfg, h1, h3).astype(dt)
        y_NEL = jnp.einsum("nei,eli->nel", a, w.experts_w2, preferred_element_type=F32)
        return jnp.einsum("nel,ne->nl", y_NEL, weights)

    nb = max(1, DENSE_MOE_BYTES // (E * I * 4))
    if N <= nb:
        return block((z_NL, weights_NE))
    n = -(-N // nb)
    pad = n * nb - N
    z = jnp.pad(z_NL, ((0, pad), (0, 0))).reshape(n, nb, -1)
    wts = jnp.pad(weights_NE, ((0, pad), (0, 0))).reshape(n, nb, E)
    return lax.map(block, (z, wts)).reshape(n * nb, -1)[:N]


DENSE_MOE_BYTES = 1 << 30  # the dense prefill form's fp32 [n, E, I] activations per rank per block, at most


def moe(cfg: KimiK3Config, w: MoEWeights, x_BD: jax.Array, tp: TP | str | None, grouped: bool = False) -> jax.Array:
    """The MoE block on B tokens: fp32 [B, D], summed over TP.  `grouped` (prefill): the experts
    over all tokens at once (dense GEMMs over the local experts, in token blocks) instead of
    per-token GEMVs (decode).  `experts_grouped` (ragged_dot) is the exact-FLOP form, kept and
    tested for when a grouped GEMM kernel makes it pay."""
    dt = x_BD.dtype
    experts = experts_dense if grouped else experts_partial
    w_Bk, ids_Bk = route(cfg, w.gate, w.e_score_correction_bias, x_BD)
    shared_BD = mlp_partial(cfg, w.shared_experts, x_BD) if w.shared_experts is not None else 0.0
    if w.routed_expert_down_proj is None:  # Kimi-Linear: experts on x, one psum for both partials
        return psum(experts(cfg, w, x_BD, w_Bk, ids_Bk) + shared_BD, tp)
    z_BL = linear(x_BD, w.routed_expert_down_proj).astype(dt)
    y_BL = psum(experts(cfg, w, z_BL, w_Bk, ids_Bk), tp)
    if cfg.latent_moe_use_norm:
        y_BL = rms_norm(y_BL, w.routed_expert_norm, cfg.rms_norm_eps)
    rout_BD = linear(y_BL.astype(dt), w.routed_expert_up_proj)
    return rout_BD + psum(shared_BD, tp)
