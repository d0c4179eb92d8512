"""Mesh axis names and the partition specs the blocks declare their weights with.

The sharding of every weight is declared once, beside the weight, in its block's `abstract`
(jaxk3.params.Param.spec); `jaxk3.model.sharding_table(cfg)` prints the table derived from
those declarations.  Weights are stored in checkpoint layout `[out, in]`, so

    COL = P("tp", None)   column-parallel: split output rows (heads / intermediate / vocab)
    ROW = P(None, "tp")   row-parallel: split input columns; the block sums its partial output
    REP = P()             replicated
    LATENT                the latent projections (MLA q_a / kv_a, the MoE's routed_expert_down_proj):
                          split by output rows when shard_latent=True (the small result rebuilt with
                          collectives.padded_all_gather), replicated otherwise (stock vLLM)
    LATENT_ROW            the MoE's routed_expert_up_proj: split by input columns when shard_latent=True
                          (its partial joins the shared experts' psum), replicated otherwise
"""
from __future__ import annotations

from jax.sharding import PartitionSpec as P

TP = "tp"
DP = "dp"  # optional data-parallel axis: splits the batch (jaxk3.distributed.make_mesh)
COL, ROW, REP = P(TP, None), P(None, TP), P()
LATENT = "latent"
LATENT_ROW = "latent_row"

