"""Vocab-parallel embedding and lm_head (docs/SPEC.md §3.7).

The tables are padded to `V_pad = cfg.padded_vocab(tp)` rows (zeros past `vocab_size`) and split
by rows over TP: rank r holds rows `[r·V_pad/tp, (r+1)·V_pad/tp)`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxk3 import collectives
from jaxk3.config import KimiK3Config
from jaxk3.layers.common import F32, TP, as_tp, psum
from jaxk3.params import COL, Param


def abstract(cfg: KimiK3Config, tp: int) -> tuple[Param, Param]:
    """(embed_tokens, lm_head): [V_pad, D] vocab-parallel tables from the checkpoint's [V, D] (a tied
    head reads the embedding)."""
    shape, ckpt = (cfg.padded_vocab(tp), cfg.hidden_size), (cfg.vocab_size, cfg.hidden_size)
    emb = Param(shape, ("model.embed_tokens.weight",), COL, init="embed", group="embed", source="pad_rows",
                ckpt_shape=ckpt)
    head_names = ("model.embed_tokens.weight",) if cfg.tie_word_embeddings else ("lm_head.weight",)
    head = Param(shape, head_names, COL, init="embed" if cfg.tie_word_embeddings else "head", group="lm_head",
                 source="pad_rows", ckpt_shape=ckpt)
    return emb, head


def embed(tokens_B: jax.Array, table_VD: jax.Array, tp: TP | str | None) -> jax.Array:
    """Look up token rows in the local vocab shard, zero the rows other ranks own, psum: x_BD."""
    tp = as_tp(tp)
    V_local = table_VD.shape[0]
    start = 0 if tp is None else lax.axis_index(tp.axis) * V_local
    local_B = tokens_B.astype(jnp.int32) - start
    mine_B = (local_B >= 0) & (local_B < V_local)
    x_BD = jnp.take(table_VD, jnp.where(mine_B, local_B, 0), axis=0)
    x_BD = jnp.where(mine_B[:, None], x_BD, jnp.zeros_like(x_BD))
    return psum(x_BD, tp)  # exactly one rank contributes a nonzero row: the sum is exact


def lm_head(h_BD: jax.Array, lm_head_VD: jax.Array, vocab_size: int, tp: TP | str | None,
            gather: str | None = None) -> jax.Array:
    """Local logits `h @ W_local.T` in fp32, gathered over TP and sliced to `[B, vocab_size]`."""
    local_BV = jnp.einsum("bd,vd->bv", h_BD.astype(lm_head_VD.dtype), lm_head_VD, preferred_element_type=F32)
    tp = as_tp(tp)
    if tp is None:
        return local_BV[:, :vocab_size]
    return collectives.gather_logits(local_BV, tp.axis, vocab_size, impl=gather or tp.gather)
