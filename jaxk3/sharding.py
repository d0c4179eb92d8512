"""THE sharding table: every weight's PartitionSpec over the "tp" mesh axis (spec §4, vLLM).

Keys are `<block>.<field>` where <block> is the weights dataclass (model, layer, kda, mla, mlp,
moe) and <field> its HF-named field.  Weights are stored in checkpoint layout `[out, in]`, so

    COL = P("tp", None)   column-parallel: split output rows (heads / intermediate / vocab)
    ROW = P(None, "tp")   row-parallel: split input columns; the block psums its partial output
    REP = P()             replicated

"latent" marks the MLA latent projections: split by output rows when `shard_latent=True`
(gathered with `collectives.padded_all_gather`), replicated otherwise (stock vLLM).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import PartitionSpec as P

TP = "tp"
DP = "dp"  # optional data-parallel axis: splits the batch (jaxk3.distributed.make_mesh)
COL, ROW, REP = P(TP, None), P(None, TP), P()
LATENT = "latent"

WEIGHT_SPECS: dict[str, Any] = {
    # trunk (vocab-parallel tables are padded to cfg.padded_vocab(tp) rows)
    "model.embed_tokens": COL, "model.lm_head": COL, "model.norm": REP,
    "model.output_attn_res_norm": REP, "model.output_attn_res_proj": REP,
    "layer.input_layernorm": REP, "layer.post_attention_layernorm": REP,
    "layer.self_attention_res_norm": REP, "layer.self_attention_res_proj": REP,
    "layer.mlp_res_norm": REP, "layer.mlp_res_proj": REP,
    # KDA: heads split; f_a / g_a (low rank, 128 wide) replicated; o_proj row-parallel
    "kda.q_proj": COL, "kda.k_proj": COL, "kda.v_proj": COL, "kda.g_proj": COL, "kda.b_proj": COL,
    "kda.q_conv1d": P(TP, None, None), "kda.k_conv1d": P(TP, None, None), "kda.v_conv1d": P(TP, None, None),
    "kda.f_a_proj": REP, "kda.f_b_proj": COL, "kda.g_a_proj": REP, "kda.g_b_proj": COL,
    "kda.A_log": P(TP), "kda.dt_bias": P(TP), "kda.o_norm": REP, "kda.o_proj": ROW,
    # MLA: latent projections switchable; heads split for q_b / q_proj / kv_b / g; o_proj row-parallel
    "mla.q_a_proj": LATENT, "mla.kv_a_proj_with_mqa": LATENT,
    "mla.q_a_layernorm": REP, "mla.kv_a_layernorm": REP,
    "mla.q_b_proj": COL, "mla.q_proj": COL, "mla.kv_b_proj": COL, "mla.g_proj": COL, "mla.o_proj": ROW,
    # dense MLP and shared experts
    "mlp.gate_proj": COL, "mlp.up_proj": COL, "mlp.down_proj": ROW,
    # MoE: router and latent projections replicated; experts split over their intermediate
    "moe.gate": REP, "moe.e_score_correction_bias": REP,
    "moe.experts_w1": P(None, TP, None), "moe.experts_w3": P(None, TP, None), "moe.experts_w2": P(None, None, TP),
    "moe.routed_expert_down_proj": REP, "moe.routed_expert_norm": REP, "moe.routed_expert_up_proj": REP,
}

#: weights kept in fp32 whatever the activation dtype (fp32 in the checkpoint, spec §2)
FP32_WEIGHTS = frozenset({"kda.q_conv1d", "kda.k_conv1d", "kda.v_conv1d", "kda.A_log", "kda.dt_bias",
                          "kda.o_norm", "moe.e_score_correction_bias"})

def cache_specs(dp_axis: str | None = None) -> dict[str, P]:
    """Cache fields: KDA state split by heads / channels, MLA latent cache replicated over TP (MQA,
    spec §4); the batch dimension split over `dp_axis` when the mesh has one."""
    return {"conv": P(None, dp_axis, None, TP, None), "state": P(None, dp_axis, TP, None, None),
            "kv": P(None, dp_axis), "length": P(dp_axis)}


CACHE_SPECS = cache_specs(None)


def spec(key: str, shard_latent: bool) -> P:
    s = WEIGHT_SPECS[key]
    if s == LATENT:
        return COL if shard_latent else REP
    return s


def block_kind(obj: Any) -> str:
    """Table prefix of a weights dataclass (its class attribute KIND, or derived from the name)."""
    return getattr(type(obj), "KIND", None) or {
        "KDAWeights": "kda", "MLAWeights": "mla", "MLPWeights": "mlp", "MoEWeights": "moe",
        "LayerWeights": "layer", "Weights": "model"}[type(obj).__name__]


def map_weights(fn, tree: Any) -> Any:
    """Apply `fn(key, array)` to every array of a weights pytree, keyed by the table key."""
    kind = block_kind(tree)
    out = {}
    for f in dataclasses.fields(tree):
        v = getattr(tree, f.name)
        if v is None:
            out[f.name] = None
        elif dataclasses.is_dataclass(v):
            out[f.name] = map_weights(fn, v)
        elif isinstance(v, (tuple, list)):
            out[f.name] = tuple(map_weights(fn, x) for x in v)
        else:
            out[f.name] = fn(f"{kind}.{f.name}", v)
    return dataclasses.replace(tree, **out)


def weight_specs(weights: Any, shard_latent: bool) -> Any:
    """A pytree of PartitionSpecs with the structure of `weights`, from WEIGHT_SPECS."""
    return map_weights(lambda key, _: spec(key, shard_latent), weights)
