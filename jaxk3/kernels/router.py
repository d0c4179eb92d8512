"""The MoE router after its logits GEMV (sigmoid, + e_score_correction_bias, top-k, renormalise,
scale) as one Pallas kernel beside its jnp reference (`jaxk3.layers.moe.select_experts`).

XLA runs it as a chain of small kernels (the sigmoid and add, a TopK custom call, the gathers, the
renormalisation) on grids of one or two blocks.  Here one grid program owns one token: it reads
the token's E logits once (padded to a power of two with -inf), and picks the k experts by k
rounds of "largest selection score, lowest index on ties" (the order `lax.top_k` returns), then
writes their sigmoid weights renormalised and scaled, and their ids.  The weights are the same
float32 arithmetic as the reference; the renormalising sum adds the k weights in selection order,
as `jnp.sum` over the k slots does, so weights agree to float32 rounding and ids exactly.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels import Kernel, interpret_only, register
from jaxk3.layers.moe import select_experts

F32 = jnp.float32


def _kernel(logits_ref, bias_ref, w_ref, ids_ref, *, E: int, Ep: int, k: int, renorm: bool, scale: float):
    from jax.experimental import pallas as pl

    b = pl.program_id(0)
    idx = jnp.arange(Ep)
    inside = idx < E
    lg = jnp.where(inside, logits_ref[b, pl.ds(0, Ep)], 0.0)  # padded tail masked below
    s = jax.nn.sigmoid(lg)
    sel = jnp.where(inside, s + jnp.where(inside, bias_ref[pl.ds(0, Ep)], 0.0), -jnp.inf)
    ws, ids = [], []
    for _ in range(k):
        best = jnp.max(sel)
        i = jnp.min(jnp.where(sel == best, idx, Ep))  # the lowest index among equal scores
        ws.append(jnp.sum(jnp.where(idx == i, s, 0.0)))
        ids.append(i)
        sel = jnp.where(idx == i, -jnp.inf, sel)
    tot = functools.reduce(lambda a, c: a + c, ws) + 1e-20 if renorm else None
    for j in range(k):
        w_ref[b, j] = (ws[j] / tot if renorm else ws[j]) * scale
        ids_ref[b, j] = ids[j].astype(jnp.int32)


def router_topk(cfg, logits_BE: jax.Array, bias_E: jax.Array, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The same function as the reference: (weights_Bk fp32, ids_Bk int32)."""
    from jax.experimental import pallas as pl

    B, E = logits_BE.shape
    Ep = 1 << (E - 1).bit_length()
    k = cfg.num_experts_per_token
    pad = ((0, 0), (0, Ep - E))
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, E=E, Ep=Ep, k=k, renorm=cfg.moe_renormalize, scale=cfg.routed_scaling_factor),
        grid=(B,), in_specs=[any_] * 2, out_specs=[any_] * 2,
        out_shape=(jax.ShapeDtypeStruct((B, k), F32), jax.ShapeDtypeStruct((B, k), jnp.int32)), interpret=interpret,
    )(jnp.pad(logits_BE.astype(F32), pad), jnp.pad(bias_E.astype(F32), pad[1]))


def reference(cfg, logits_BE, bias_E):
    return select_experts(cfg, logits_BE, bias_E)


def fits(cfg, logits_BE, bias_E, **_) -> str | None:
    if cfg.use_grouped_topk and cfg.num_expert_group > 1:
        return f"router_topk kernel has no group-limited selection (num_expert_group {cfg.num_expert_group})"
    if cfg.num_experts_per_token > 32 or logits_BE.shape[1] > 4096:
        return (f"router_topk kernel unrolls k <= 32 rounds over <= 4096 experts, got k "
                f"{cfg.num_experts_per_token}, E {logits_BE.shape[1]}")
    return None


register(Kernel("router_topk", reference, router_topk, platforms=("gpu",), fits=fits,
                unproven=interpret_only("test_router_topk_kernel_on_gpu")))
