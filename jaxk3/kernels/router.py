"""The MoE router after its logits GEMV (sigmoid, + e_score_correction_bias, top-k, renormalise,
scale) as one Pallas kernel beside its jnp reference `select_experts`.

XLA runs it as a chain of small kernels (the sigmoid and add, a TopK custom call, the gathers, the
renormalisation) on grids of one or two blocks.  Here one grid program owns one token: it reads
the token's E logits once (padded to a power of two with -inf), and picks the k experts by k
rounds of "largest selection score, lowest index on ties" (the order `lax.top_k` returns), then
writes their sigmoid weights renormalised and scaled, and their ids.  The weights are the same
float32 arithmetic as the reference; the renormalising sum adds the k weights in selection order,
as `jnp.sum` over the k slots does, so weights agree to float32 rounding and ids exactly.

Measured on an H200 (docs/PERF.md, issue 22): 1.30-1.36x faster than XLA at K3's router (896
experts, k 16) and 0.56-0.65x at Kimi-Linear's (256 experts, k 8), B = 1 and 8; its compiled
real-dims tests passed.  `fits` lets `kernels="auto"` take it only where it won (`MEASURED`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxk3.config import KimiK3Config
from jaxk3.kernels.registry import Kernel, register

F32 = jnp.float32
# (B bucket (1 or 8), E, k) -> (kernel us, XLA us): a dependent chain of 20 router calls, same run
# (H200, jax 0.11.2, 2026-12-01; docs/PERF.md, "Every device kernel at real per-rank dims").
MEASURED: dict[tuple[int, int, int], tuple[float, float]] = {
    (1, 896, 16): (12.8, 17.3), (8, 896, 16): (13.8, 17.9),  # K3
    (1, 256, 8): (20.5, 13.4), (8, 256, 8): (21.6, 12.1),  # Kimi-Linear-48B
}
MARGIN = 1.05  # run-to-run spread of these timings is a few per cent
MAX_B = 8  # measured at decode batch sizes only (B <= 8); prefill's token counts are not


def _bucket(B: int) -> int | None:
    return 1 if B == 1 else 8 if B <= MAX_B else None


def prefer_kernel(B: int, E: int, k: int, margin: float = MARGIN) -> bool:
    """Whether the kernel beat XLA by `margin` at this shape on the H200 (unmeasured: False)."""
    m = MEASURED.get((_bucket(B), E, k))
    return bool(m) and m[1] / m[0] >= margin


def select_experts(cfg: KimiK3Config, logits_BE: jax.Array, bias_E: jax.Array) -> tuple[jax.Array, jax.Array]:
    """sigmoid, + e_score_correction_bias (selection only), top-k (group-limited when configured),
    renormalise, scale: (weights_Bk fp32, ids_Bk).  The `router_topk` kernel's reference."""
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


def router_topk(cfg, logits_BE: jax.Array, bias_E: jax.Array, interpret: bool = False,
                only_where_faster: bool = True) -> tuple[jax.Array, jax.Array]:
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


def reference(cfg, logits_BE: jax.Array, bias_E: jax.Array, only_where_faster: bool = True):
    """`select_experts` (the kernel's keyword `only_where_faster` is the selection's, not the math's)."""
    return select_experts(cfg, logits_BE, bias_E)


def fits(cfg, logits_BE, bias_E, only_where_faster: bool = True, **_) -> str | None:
    """Why this call does not suit the kernel (None: it does).  With `only_where_faster` (the default)
    a shape where the kernel did not beat XLA on the H200 (`MEASURED`), or was not measured, is refused
    with the numbers, so that kernels="auto" keeps XLA there; False: any shape the kernel can run."""
    if cfg.use_grouped_topk and cfg.num_expert_group > 1:
        return f"router_topk kernel has no group-limited selection (num_expert_group {cfg.num_expert_group})"
    B, E = logits_BE.shape
    k = cfg.num_experts_per_token
    if k > 32 or E > 4096:
        return f"router_topk kernel unrolls k <= 32 rounds over <= 4096 experts, got k {k}, E {E}"
    if only_where_faster and not prefer_kernel(B, E, k):
        m = MEASURED.get((_bucket(B), E, k))
        return (f"router_topk kernel: XLA is faster at B {B}, {E} experts, k {k} on an H200 (kernel {m[0]} us, "
                f"XLA {m[1]} us)" if m else f"router_topk kernel: B {B}, {E} experts, k {k} not measured against "
                "XLA (only_where_faster=False runs it)")
    return None


# Proven: tests/test_kernels_real.py passed compiled at K3's and Kimi-Linear's router shapes, B 1 and 8, on
# an H200 (2026-12-01); `auto` takes it only at the shapes where it won (`fits`).
register(Kernel("router_topk", reference, router_topk, platforms=("gpu",), fits=fits,
                measured="K3 (896 experts, k 16): 1.30-1.36x XLA; Kimi-Linear (256, k 8): 0.56-0.65x, where auto "
                         "keeps XLA (H200, jax 0.11.2, 2026-12-01)"))
