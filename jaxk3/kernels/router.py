"""The MoE router after its logits GEMV (sigmoid, + e_score_correction_bias, top-k, renormalise,
scale) as one Pallas kernel beside its jnp reference `select_experts`.

XLA runs it as a chain of small kernels (the sigmoid and add, a TopK custom call, the gathers, the
renormalisation) on grids of one or two blocks.  Here one grid program owns one token: it reads
the token's E logits once (padded to a power of two with -inf), and picks the k experts by k
rounds of "largest selection score, lowest index on ties" (the order `lax.top_k` returns), then
writes their sigmoid weights renormalised and scaled, and their ids.  The weights are the same
float32 arithmetic as the reference; the renormalising sum adds the k weights in selection order,
as `jnp.sum` over the k slots does, so weights agree to float32 rounding and ids exactly.

With `x_BD` (decode, Kimi-Linear: the block's input handed over un-normed, jaxk3.layers.common.Normed)
the program also writes the token's normed row RMSNorm(x; w) for the experts, so that neither the norm
nor the five small kernels of XLA's selection would run in the step: the logits come from the `gemv_norm`
kernel, which norms x in its prologue.  That form compiled and passed its tests on an H200 but made the
48B step's MoE block slower (56.0 vs 51.2 us: two latency-bound kernels against XLA's eight), so `auto`
does not take it (`NORMED_PROVEN`); kernels="on" runs it.

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
from jaxk3.kernels.rms_norm import rms_norm_as

F32 = jnp.float32
# (B bucket (1 or 8), E, k) -> (kernel us, XLA us): a dependent chain of 20 router calls, same run
# (H200, jax 0.11.2, 2026-12-01; docs/PERF.md, "Every device kernel at real per-rank dims").
MEASURED: dict[tuple[int, int, int], tuple[float, float]] = {
    (1, 896, 16): (12.8, 17.3), (8, 896, 16): (13.8, 17.9),  # K3
    (1, 256, 8): (20.5, 13.4), (8, 256, 8): (21.6, 12.1),  # Kimi-Linear-48B
}
MARGIN = 1.05  # run-to-run spread of these timings is a few per cent
NUM_WARPS = 4  # the bare form's, as measured
NORMED_WARPS = 1  # the normed form's: its k rounds of reductions as warp shuffles alone
NORMED_PROVEN = False  # the x_BD form: its compiled tests passed on an H200, but in the 48B step the MoE block took
# 56.0 us with it and its logits GEMV against 51.2 with XLA's norm and selection (docs/PERF.md, 2026-12-02)
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


def _kernel(logits_ref, bias_ref, *refs, E: int, Ep: int, k: int, renorm: bool, scale: float,
            norm: tuple[int, int, float] | None):
    from jax.experimental import pallas as pl

    x_ref, g_ref, w_ref, ids_ref, xn_ref = refs if norm else (None, None, *refs, None)
    b = pl.program_id(0)
    idx = jnp.arange(Ep)
    inside = idx < E
    lg = jnp.where(inside, logits_ref[b, pl.ds(0, Ep)], 0.0)  # padded tail masked below
    s = jax.nn.sigmoid(lg)
    sel = jnp.where(inside, s + jnp.where(inside, bias_ref[pl.ds(0, Ep)], 0.0), -jnp.inf)
    ws, ids = [], []
    for _ in range(k):
        best = jnp.max(sel)
        i = jnp.min(jnp.where(sel == best, idx, Ep)).astype(jnp.int32)  # the lowest index among equal scores
        ws.append(jnp.sum(jnp.where(idx == i, s, 0.0)))
        ids.append(i)
        sel = jnp.where(idx == i, -jnp.inf, sel)
    tot = functools.reduce(lambda a, c: a + c, ws) + 1e-20 if renorm else None
    for j in range(k):
        w_ref[b, j] = (ws[j] / tot if renorm else ws[j]) * scale
        ids_ref[b, j] = ids[j]
    if norm:  # the token's normed row for the experts: RMSNorm(x; g) in x's dtype, the reference's order
        D, chunk, eps = norm
        n = D // chunk

        def part(c):
            return pl.ds(pl.multiple_of(c * chunk, chunk), chunk)

        def sq(c, acc):  # element-wise, reduced once after the loop (not a reduction per part)
            xc = x_ref[b, part(c)].astype(F32)
            return acc + xc * xc
        r = jax.lax.rsqrt(jnp.sum(lax.fori_loop(0, n, sq, jnp.zeros((chunk,), F32))) / D + eps)

        def put(c, carry):
            xn_ref[b, part(c)] = ((g_ref[part(c)].astype(F32) * x_ref[b, part(c)].astype(F32)) * r
                                  ).astype(xn_ref.dtype)
            return carry
        lax.fori_loop(0, n, put, 0)


def _chunk(D: int) -> int:
    """The largest power of two <= 1024 dividing D (Triton blocks are powers of two): 256 for 2304."""
    c = 1024
    while c > 1 and D % c:
        c //= 2
    return c


def router_topk(cfg, logits_BE: jax.Array, bias_E: jax.Array, interpret: bool = False,
                only_where_faster: bool = True, x_BD: jax.Array | None = None, norm_w: jax.Array | None = None,
                eps: float = 0.0, num_warps: int | None = None):
    """The same function as the reference: (weights_Bk fp32, ids_Bk int32), and with `x_BD` the tokens'
    normed rows RMSNorm(x; norm_w, eps) in x's dtype as a third output (the MoE experts' input, which the
    router's logits GEMV normed in its own prologue)."""
    from jax.experimental import pallas as pl

    from jaxk3.kernels.registry import triton_params

    B, E = logits_BE.shape
    Ep = 1 << (E - 1).bit_length()
    k = cfg.num_experts_per_token
    logits, bias = logits_BE.astype(F32), bias_E.astype(F32)
    if Ep != E:  # XLA pads (a kernel of its own) only where the expert count is not a power of two (K3's 896)
        logits, bias = jnp.pad(logits, ((0, 0), (0, Ep - E))), jnp.pad(bias, (0, Ep - E))
    args, outs = [logits, bias], [jax.ShapeDtypeStruct((B, k), F32), jax.ShapeDtypeStruct((B, k), jnp.int32)]
    norm = None
    if x_BD is not None:
        D = x_BD.shape[-1]
        norm = (D, _chunk(D), float(eps))
        args += [x_BD, norm_w]
        outs.append(jax.ShapeDtypeStruct(x_BD.shape, x_BD.dtype))
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_kernel, E=E, Ep=Ep, k=k, renorm=cfg.moe_renormalize, scale=cfg.routed_scaling_factor,
                          norm=norm),
        grid=(B,), in_specs=[any_] * len(args), out_specs=[any_] * len(outs), out_shape=tuple(outs),
        interpret=interpret, name="router_topk",
        **triton_params(num_warps or (NORMED_WARPS if norm else NUM_WARPS), 1, interpret))(*args)
    return tuple(out)


def reference(cfg, logits_BE: jax.Array, bias_E: jax.Array, only_where_faster: bool = True,
              x_BD: jax.Array | None = None, norm_w: jax.Array | None = None, eps: float = 0.0, num_warps: int = 0):
    """`select_experts`, and with `x_BD` RMSNorm(x; norm_w, eps) in x's dtype beside (the kernel's keywords
    `only_where_faster` and `num_warps` are the selection's and the kernel's, not the math's)."""
    w, ids = select_experts(cfg, logits_BE, bias_E)
    if x_BD is None:
        return w, ids
    return w, ids, rms_norm_as(x_BD, norm_w, eps)


def fits(cfg, logits_BE, bias_E, only_where_faster: bool = True, x_BD=None, norm_w=None, eps: float = 0.0,
         **_) -> str | None:
    """Why this call does not suit the kernel (None: it does).  With `only_where_faster` (the default)
    a shape where the kernel did not beat XLA on the H200 (`MEASURED`), or was not measured, is refused
    with the numbers, so that kernels="auto" keeps XLA there; False: any shape the kernel can run.  The
    form that also norms the experts' input (`x_BD`) is gated by `NORMED_PROVEN` instead (XLA's path there
    is the norm's two kernels besides the selection's)."""
    if cfg.use_grouped_topk and cfg.num_expert_group > 1:
        return f"router_topk kernel has no group-limited selection (num_expert_group {cfg.num_expert_group})"
    B, E = logits_BE.shape
    k = cfg.num_experts_per_token
    if k > 32 or E > 4096:
        return f"router_topk kernel unrolls k <= 32 rounds over <= 4096 experts, got k {k}, E {E}"
    if x_BD is not None:
        if x_BD.ndim != 2 or x_BD.shape[0] != B or norm_w is None or norm_w.shape != x_BD.shape[1:]:
            return (f"router_topk kernel: x [B, D] and its norm weight [D] for B = {B} logits rows, got x "
                    f"{getattr(x_BD, 'shape', None)} and {getattr(norm_w, 'shape', None)}")
        if _chunk(x_BD.shape[1]) < 16:
            return f"router_topk kernel: D = {x_BD.shape[1]} has no power-of-two part >= 16 to norm it by"
        if only_where_faster and not NORMED_PROVEN:
            return ("router_topk kernel: the form that norms the experts' input made the 48B step's MoE block slower "
                    "on an H200 (56.0 vs 51.2 us); kernels='on' runs it")
        return None
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
