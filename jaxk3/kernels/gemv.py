"""Decode GEMV y[B, N] (fp32) = x[B, K] @ W^T for B <= 8 and bf16 weights, as one Pallas kernel
beside its jnp reference (XLA's dot, `jnp.einsum('bk,nk->bn', ..., preferred_element_type=f32)`).

At decode the projections are bandwidth-bound: each weight byte is read once per step, so the
kernel's whole job is to keep enough bytes in flight.  The grid is (N / bn, splits): a program owns
bn output rows and one of `splits` equal parts of K, and walks its part in tiles of [bn, bk]
weights (a Triton loop that num_stages software-pipelines); where bn does not divide N (K3's fused
KDA rows at TP 8, 6284) the last program takes the last bn rows, overlapping its neighbour, which
computes the same values for the rows they share.  Where N is short (an o_proj-sized
matrix, a q_a down-projection) the split over K multiplies the programs so that every SM streams;
the `splits` partial sums [splits, Bp, N] are added by XLA in the fusion that consumes y (the add
of the residual, the activation), so the split costs no extra kernel in the step.

Two ways to multiply a tile, chosen per shape (`Config.dot`):
  dot=False  (B = 1) the tile times x broadcast, accumulated element-wise in a [bn, bk] fp32 register
             tile and reduced over K once at the end;
  dot=True   x padded to 16 rows, tl.dot on the tensor cores (bf16 in, fp32 accumulate): any B <= 8.

With `norm_w` the input is RMSNorm(x; norm_w, eps), cast to x's dtype, computed in the kernel's
prologue instead of by XLA before it (two kernels of the step: the sum of squares, then the scaling):
each program first sums x² over the whole row (the row is a few KB, read from L2 by every program),
then scales each input tile as it loads it, in the reference's order ((w ⊙ x) · rsqrt(mean + eps)).
Only the sum's order differs from XLA's, so the normed input agrees to one rounding of the activation
dtype at most.

Weight layout ("serving layout", made at load): "nk" is the checkpoint's [N, K] row-major, "kn" its
transpose [K, N].  The per-shape configurations (`CONFIGS`) come from the sweep on an H200 recorded
in docs/PERF.md; shapes not in the table take `default_config`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels.registry import Kernel, dot_nt, pow2, register, triton_params
from jaxk3.kernels.rms_norm import gated_rms_norm, rms_norm_as

F32 = jnp.float32
MAX_B = 8


@dataclasses.dataclass(frozen=True)
class Config:
    bn: int = 16  # output rows per program
    bk: int = 256  # K elements per tile (a power of two that divides K / splits)
    splits: int = 1  # programs along K; the partial sums are added by XLA in y's consumer
    dot: bool = False  # tensor-core dot on x padded to 16 rows (any B) or element-wise (B = 1)
    num_warps: int = 4
    num_stages: int = 3
    unroll: bool = False  # the K loop written out (all tile loads visible at once) instead of a Triton loop


# (layout, B bucket (1 or 8), N, K) -> the fastest Config of the H200 sweep (docs/PERF.md, "Decode GEMV").
CONFIGS: dict[tuple[str, int, int, int], Config] = {
    ("nk", 1, 2304, 2304): Config(bn=16, bk=256, splits=9),
    ("nk", 1, 18432, 2304): Config(bn=16, bk=256, splits=1, num_warps=8),
    ("nk", 1, 12288, 2304): Config(bn=32, bk=256, splits=1, num_warps=8, unroll=True),
    ("nk", 1, 2304, 4096): Config(bn=16, bk=256, splits=4, unroll=True),
    ("nk", 1, 1536, 7168): Config(bn=16, bk=256, splits=7),
    ("nk", 1, 4608, 7168): Config(bn=16, bk=256, splits=2, num_warps=8),
    ("nk", 1, 2304, 9216): Config(bn=16, bk=256, splits=4, num_warps=8),
    ("nk", 1, 7168, 1536): Config(bn=8, bk=512, splits=1),
    ("nk", 8, 2304, 2304): Config(bn=32, bk=128, splits=9, dot=True, num_stages=4),
    ("nk", 8, 18432, 2304): Config(bn=32, bk=128, splits=1, dot=True),
    ("nk", 8, 2304, 4096): Config(bn=32, bk=128, splits=8, dot=True),
    ("nk", 8, 1536, 7168): Config(bn=32, bk=128, splits=14, dot=True),
    # the serving layout's fused projections (second sweep, same day: docs/PERF.md "Serving layout")
    ("nk", 1, 12576, 2304): Config(bn=16, bk=256, splits=1, num_stages=1),
    ("nk", 1, 6720, 2304): Config(bn=16, bk=256, splits=3),
    ("nk", 1, 2048, 2304): Config(bn=16, bk=256, splits=9, unroll=True),
    ("nk", 8, 12576, 2304): Config(bn=32, bk=128, splits=2, dot=True),
    ("nk", 8, 6720, 2304): Config(bn=32, bk=128, splits=3, dot=True),
    ("nk", 8, 2048, 2304): Config(bn=32, bk=128, splits=9, dot=True, num_stages=4),
    ("nk", 1, 1800, 7168): Config(bn=8, bk=512, splits=7),
}
# (B bucket, N, K) -> (kernel us, XLA dot us): the CONFIGS entry and XLA's dot ([N, K] weights), each
# in a dependent chain of 20 with its add, in the same run (H200, jax 0.11.2, 2026-12-01, second run;
# docs/PERF.md).  `fits` lets `auto` take the kernel only where it won by `MARGIN`.
MEASURED: dict[tuple[int, int, int], tuple[float, float]] = {
    (1, 2304, 2304): (9.71, 6.14), (1, 18432, 2304): (25.33, 29.78), (1, 12288, 2304): (18.28, 22.88),
    (1, 2304, 4096): (8.95, 7.88), (1, 1536, 7168): (9.57, 10.49), (1, 4608, 7168): (21.50, 23.43),
    (1, 2304, 9216): (16.13, 16.83), (1, 7168, 1536): (9.72, 15.19),
    (8, 2304, 2304): (8.26, 7.80), (8, 18432, 2304): (25.68, 26.87), (8, 2304, 4096): (9.75, 9.20),
    (8, 1536, 7168): (11.19, 10.92),
    # fused shapes (Kimi-Linear KDA q|k|v|f_a|b|g_a, MLA kv_a|q, shared gate|up; K3 TP 8 MLA q_a|kv_a|g)
    (1, 12576, 2304): (19.0, 25.2), (1, 6720, 2304): (12.2, 20.9), (1, 2048, 2304): (6.4, 5.8),
    (8, 12576, 2304): (20.3, 20.0), (8, 6720, 2304): (13.4, 12.9), (8, 2048, 2304): (7.7, 10.0),
    (1, 1800, 7168): (12.4, 11.5),
}
MARGIN = 1.05  # run-to-run spread of these timings is a few per cent


NEAR = 0.05  # a shape within 5% of a measured N (same K, same batch bucket) takes that measurement


def measured(B: int, N: int, K: int) -> tuple[tuple[int, int, int], tuple[float, float]] | None:
    """The measured shape nearest to (B, N, K) within NEAR in N (same K and batch bucket), and its
    (kernel us, XLA us); None when nothing near was measured.  A fused projection whose members add
    a few small rows to a measured one (Kimi-Linear's KDA q|k|v|f_a|b|g_a: 12576 rows next to 12288)
    streams like it."""
    b = 1 if B == 1 else 8
    near = [(abs(n - N), (bb, n, k)) for (bb, n, k) in MEASURED if bb == b and k == K and abs(n - N) <= NEAR * n]
    if not near:
        return None
    key = min(near)[1]
    return key, MEASURED[key]


def prefer_kernel(B: int, N: int, K: int, margin: float = MARGIN) -> bool:
    """Whether the kernel beat XLA's dot at this shape (or the nearest measured one) by `margin` on
    the H200 (unmeasured: False)."""
    m = measured(B, N, K)
    return bool(m) and m[1][1] / m[1][0] >= margin


def default_config(B: int, N: int, K: int, sms: int = 132) -> Config:
    """A tile that divides the shape, and enough programs (>= 4 per SM) for the split over K."""
    bk = next((b for b in (256, 128, 64) if K % b == 0), 256)  # no tile divides: `fits` says so
    dot = B > 1
    bn = next((b for b in ((32, 16) if dot else (16, 32, 64, 8)) if N % b == 0), 16)
    steps = K // bk
    splits = 1
    for s in range(1, steps + 1):
        if steps % s == 0:
            splits = s
            if (N // bn) * s >= 4 * sms:
                break
    return Config(bn=bn, bk=bk, splits=splits, dot=dot)


def config_for(B: int, N: int, K: int, layout: str = "nk") -> Config:
    """The tuned config of this shape, else of the nearest measured shape if its tile divides N, else
    `default_config`."""
    c = CONFIGS.get((layout, 1 if B == 1 else 8, N, K))
    if c is None and (m := measured(B, N, K)) is not None:
        c = CONFIGS.get((layout, m[0][0], m[0][1], K))
        if c is not None and N % c.bn:
            c = None
    return c or default_config(B, N, K)


def _rows(w: jax.Array, layout: str) -> int:
    """N, the output rows of a weight in `layout` ("nk": [N, K]; "kn": [K, N])."""
    return w.shape[0] if layout == "nk" else w.shape[1]


def _loop(steps: int, body, init, unroll: bool):
    if not unroll:
        return jax.lax.fori_loop(0, steps, body, init)
    acc = init
    for i in range(steps):
        acc = body(i, acc)
    return acc


def _kernel(x_ref, w_ref, *refs, layout: str, bn: int, bk: int, steps: int, dot: bool, unroll: bool, N: int,
            eps: float | None, K: int):
    from jax.experimental import pallas as pl

    g_ref, o_ref = refs if eps is not None else (None, refs[0])
    n, s = pl.program_id(0), pl.program_id(1)
    if N % bn:  # the last program's rows end at N: it overlaps its neighbour, writing the same values there
        rows = pl.ds(jnp.minimum(n * bn, N - bn), bn)
    else:
        rows = pl.ds(pl.multiple_of(n * bn, bn), bn)
    k0 = s * (steps * bk)

    def tile(i):
        cols = pl.ds(pl.multiple_of(k0 + i * bk, bk), bk)
        w = w_ref[rows, cols] if layout == "nk" else w_ref[cols, rows]  # [bn, bk] or [bk, bn]
        return cols, w

    if eps is not None:  # the prologue: rsqrt(mean(x²) + eps) over the whole row (each row's with dot: [16, 1])
        # x² accumulated element-wise over the row's tiles (all loads issued at once: the loop is written out)
        # and reduced once: a reduction per tile would chain K / bk cross-warp reductions before the first weight
        acc = None
        for i in range(K // bk):
            xt = (x_ref[:, pl.ds(i * bk, bk)] if dot else x_ref[0, pl.ds(i * bk, bk)]).astype(F32)
            acc = xt * xt if acc is None else acc + xt * xt
        ss = jnp.sum(acc, axis=1, keepdims=True) if dot else jnp.sum(acc)
        r = jax.lax.rsqrt(ss / K + eps)

    def xin(cols):
        """The input at `cols` ([16, bk] with dot, else row 0's [bk]), normed as the prologue says."""
        x = x_ref[:, cols] if dot else x_ref[0, cols]
        if eps is None:
            return x
        xn = (g_ref[cols].astype(F32) * x.astype(F32)) * r
        return xn.astype(x_ref.dtype).astype(w_ref.dtype)

    if dot:
        def body(i, acc):
            cols, w = tile(i)
            x = xin(cols)  # [16, bk]
            if layout == "nk":
                return acc + dot_nt(x, w)
            return acc + jnp.dot(x, w, preferred_element_type=F32)
        acc = _loop(steps, body, jnp.zeros((x_ref.shape[0], bn), F32), unroll)
        o_ref[s, :, rows] = acc
    else:
        def body(i, acc):
            cols, w = tile(i)
            x = xin(cols).astype(F32)  # [bk]
            if layout == "nk":
                return acc + w.astype(F32) * x[None, :]
            return acc + w.astype(F32) * x[:, None]
        shape = (bn, bk) if layout == "nk" else (bk, bn)
        acc = _loop(steps, body, jnp.zeros(shape, F32), unroll)
        o_ref[s, 0, rows] = jnp.sum(acc, axis=1 if layout == "nk" else 0)


def partials(x_BK: jax.Array, w: jax.Array, layout: str = "nk", config: Config | None = None,
             interpret: bool = False, norm_w: jax.Array | None = None, eps: float = 0.0) -> jax.Array:
    """The kernel's raw output: fp32 [splits, Bp, N] partial sums (Bp = 16 with dot, else 1)."""
    from jax.experimental import pallas as pl

    B, K = x_BK.shape
    N = _rows(w, layout)
    c = config or config_for(B, N, K, layout)
    steps = K // c.splits // c.bk
    Bp = 16 if c.dot else 1
    x = x_BK.astype(w.dtype) if norm_w is None else x_BK  # normed: the prologue reads x as it is
    if Bp != B:
        x = jnp.pad(x, ((0, Bp - B), (0, 0)))
    args = (x, w) if norm_w is None else (x, w, norm_w)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    kw = triton_params(c.num_warps, c.num_stages, interpret)
    return pl.pallas_call(
        functools.partial(_kernel, layout=layout, bn=c.bn, bk=c.bk, steps=steps, dot=c.dot, unroll=c.unroll, N=N,
                          eps=None if norm_w is None else float(eps), K=K),
        grid=(-(-N // c.bn), c.splits), in_specs=[any_] * len(args), out_specs=any_,
        out_shape=jax.ShapeDtypeStruct((c.splits, Bp, N), F32), interpret=interpret,
        name="gemv" if norm_w is None else "gemv_norm", **kw)(*args)


def add_splits(p_SBN: jax.Array) -> jax.Array:
    """The product from the kernel's partial sums over its K splits [S, B, N]: their sum [B, N] (XLA adds them in the
    fusion that consumes it; one split: the array itself)."""
    return p_SBN[0] if p_SBN.shape[0] == 1 else jnp.sum(p_SBN, axis=0)


def gemv(x_BK: jax.Array, w: jax.Array, layout: str = "nk", config: Config | None = None,
         interpret: bool = False, only_where_faster: bool = True, norm_w: jax.Array | None = None,
         eps: float = 0.0, sums: bool = False) -> jax.Array:
    """The same function as the reference: fp32 [B, N] = x @ W^T (W [N, K] for "nk", [K, N] for "kn"),
    x first normed (RMSNorm(x; norm_w, eps) in x's dtype) where `norm_w` is given.  `sums`: the partial sums
    over the K splits [splits, B, N] instead, for a consumer that adds them itself."""
    p = partials(x_BK, w, layout, config, interpret, norm_w, eps)
    if sums:
        return p[:, : x_BK.shape[0]]
    return add_splits(p)[: x_BK.shape[0]]


def reference(x_BK: jax.Array, w: jax.Array, layout: str = "nk", config: Config | None = None,
              only_where_faster: bool = True, norm_w: jax.Array | None = None, eps: float = 0.0,
              sums: bool = False) -> jax.Array:
    """XLA's dot; `sums`: as one partial sum [1, B, N]."""
    if norm_w is not None:
        x_BK = rms_norm_as(x_BK, norm_w, eps)
    spec = "bk,nk->bn" if layout == "nk" else "bk,kn->bn"
    y = jnp.einsum(spec, x_BK.astype(w.dtype), w, preferred_element_type=F32)
    return y[None] if sums else y


def fits(x_BK, w, layout: str = "nk", config: Config | None = None, only_where_faster: bool = True,
         norm_w: jax.Array | None = None, eps: float = 0.0, **_) -> str | None:
    """Why this call does not suit the kernel (None: it does).  With `only_where_faster` (the default)
    a shape where the kernel did not beat XLA's dot on the H200 (`MEASURED`), or was not measured, is
    refused with the numbers, so that kernels="auto" keeps XLA there; False: any shape that fits."""
    if layout not in ("nk", "kn"):
        return f"gemv kernel: layout must be 'nk' or 'kn', got {layout!r}"
    if x_BK.ndim != 2 or w.ndim != 2:
        return f"gemv kernel takes x [B, K] and a 2-D weight, got {x_BK.shape} and {w.shape}"
    B, K = x_BK.shape
    N, Kw = w.shape if layout == "nk" else w.shape[::-1]
    if Kw != K:
        return f"gemv kernel: x has K = {K}, the weight ({layout}) {w.shape}"
    if B > MAX_B:
        return f"gemv kernel is for decode (B <= {MAX_B}), got B = {B}"
    if w.dtype != jnp.bfloat16:
        return f"gemv kernel streams bf16 weights, got {w.dtype}"
    if norm_w is not None and norm_w.shape != (K,):
        return f"gemv kernel: the norm weight must be [K] = [{K}], got {norm_w.shape}"
    c = config or config_for(B, N, K, layout)
    if B > 1 and not c.dot:
        return f"gemv kernel: B = {B} needs the dot variant (config {c})"
    if (not (pow2(c.bn) and pow2(c.bk)) or N < c.bn or K % (c.splits * c.bk) or c.bn < (16 if c.dot else 8)
            or c.bk < 16):
        return (f"gemv kernel: the tile bn {c.bn} x bk {c.bk} (powers of two, bk >= 16, bn >= 16 with dot, >= 8 "
                f"without) with {c.splits} K splits must divide K {K} and bn fit in N {N}")
    if only_where_faster and not prefer_kernel(B, N, K):
        m = measured(B, N, K)
        return (f"gemv kernel: XLA's dot is as fast at B {B}, N {N}, K {K} on an H200 (measured at N {m[0][1]}: "
                f"kernel {m[1][0]} us, XLA {m[1][1]} us)" if m else
                f"gemv kernel: B {B}, N {N}, K {K} not measured against XLA's dot (only_where_faster=False runs it)")
    return None


# Proven: tests/test_gemv.py::test_gemv_kernel_on_gpu passed at the 14 preset shapes on an H200
# (2026-12-01); `auto` takes it only at the shapes where it won (`fits`).
register(Kernel("gemv", reference, gemv, platforms=("gpu",), fits=fits,
                measured="B=1: 1.04-1.71x XLA's dot at the fused and >= 22 MB projections, 0.8-0.9x at <= 19 MB "
                         "(auto keeps XLA there); B=8: 0.95-1.30x (H200, jax 0.11.2, 2026-12-01; MEASURED)"))


# (B bucket, N, K) -> the normed GEMV's tiling where it differs from `config_for`'s: the MoE router's logits
# (E rows: 64 kept by the benches, 256 in Kimi-Linear-48B) in one pass over K, so that no XLA kernel adds K
# splits' partial sums before the router's own kernel reads them.
NORM_CONFIGS: dict[tuple[int, int, int], Config] = {
    (1, 64, 2304): Config(bn=8, bk=256, splits=1), (1, 256, 2304): Config(bn=8, bk=256, splits=1),
    (8, 64, 2304): Config(bn=16, bk=128, splits=1, dot=True), (8, 256, 2304): Config(bn=16, bk=128, splits=1, dot=True),
}


def norm_config_for(B: int, N: int, K: int, layout: str = "nk") -> Config:
    c = NORM_CONFIGS.get((1 if B == 1 else 8, N, K)) if layout == "nk" else None
    return c or config_for(B, N, K, layout)


# (B, N, K) where the normed GEMV was measured in the step (Kimi-Linear-48B's serving layout at TP 1: KDA in_proj,
# MLA in_proj, the dense MLP's gate|up; docs/PERF.md, 2026-12-02, fourth session): auto takes it there (and at
# an N within NEAR of one), at B = 1.
NORM_MEASURED = {(1, 12576, 2304), (1, 6720, 2304), (1, 18432, 2304)}


def _norm_measured(B: int, N: int, K: int) -> bool:
    return any(b == B and k == K and abs(n - N) <= NEAR * n for b, n, k in NORM_MEASURED)


def _norm_reference(x_BK, w, norm_w, eps: float, layout: str = "nk", config: Config | None = None,
                    only_where_faster: bool = True, sums: bool = False) -> jax.Array:
    return reference(x_BK, w, layout, config, norm_w=norm_w, eps=eps, sums=sums)


def _norm_device(x_BK, w, norm_w, eps: float, layout: str = "nk", config: Config | None = None,
                 interpret: bool = False, only_where_faster: bool = True, sums: bool = False) -> jax.Array:
    c = config or norm_config_for(x_BK.shape[0], _rows(w, layout), x_BK.shape[1], layout)
    return gemv(x_BK, w, layout, c, interpret, norm_w=norm_w, eps=eps, sums=sums)


def _norm_fits(x_BK, w, norm_w, eps: float, layout: str = "nk", config: Config | None = None,
               only_where_faster: bool = True, **_) -> str | None:
    """The GEMV's own conditions, and `auto` only where the step was measured faster with it (`NORM_MEASURED`:
    one row, the shapes of the 48B's first GEMVs; XLA's path there is the norm's two kernels and then the dot).
    At B = 8 the step was 0.8% slower with it (its compiled tests pass there).  only_where_faster=False (as
    kernels="on" passes) runs it wherever it fits."""
    if x_BK.ndim != 2 or w.ndim != 2:
        return fits(x_BK, w, layout, config, only_where_faster=False, norm_w=norm_w, eps=eps)
    B, K = x_BK.shape
    N = _rows(w, layout)
    if only_where_faster and not _norm_measured(B, N, K):
        return (f"gemv_norm kernel: auto takes it where the step was measured faster with it (B = 1 at N x K in "
                f"{sorted((n, k) for _, n, k in NORM_MEASURED)}), got B {B}, N {N}, K {K}")
    return fits(x_BK, w, layout, config or norm_config_for(B, N, K, layout), only_where_faster=False,
                norm_w=norm_w, eps=eps)


# The GEMV with the RMSNorm prologue: the blocks' first projections at decode take it (jaxk3.layers.common.Normed).
# Proven at B = 1: its compiled tests (tests/test_gemv.py, the fused input projections and the router's logits)
# passed on an H200, and the Kimi-Linear-48B step took 2739.0 us with it against 2790.6 without (2026-12-02,
# fourth session; docs/PERF.md).
register(Kernel("gemv_norm", _norm_reference, _norm_device, platforms=("gpu",), fits=_norm_fits,
                measured="B=1, Kimi-Linear-48B: the step 1.9% faster with it (2739.0 vs 2790.6 us; KDA blocks 42.8 -> "
                         "38.4 us, MLA 44.6 -> 41.0); B=8 not taken (the step 0.8% slower) (H200, jax 0.11.2, "
                         "2026-12-02)"))


# ---------------------------------------------------------------- the gated per-head norm in the prologue
# KDA's output o (fp32, per head of d values) reaches o_proj as gated_rms_norm(o; w, z) = RMSNorm over each head's d
# values ⊙ sigmoid(z), cast to the activation dtype: two XLA fusions per layer before o_proj's dot.  Here one program
# of the GEMV norms the heads of its own K range as it loads them (a head never straddles a tile: tiles are whole
# heads), so the norm costs no kernel of its own.  One row, "nk" weights.


def _gnorm_kernel(x_ref, z_ref, g_ref, w_ref, o_ref, *, bn: int, hk: int, d: int, steps: int, eps: float, dt,
                  unroll: bool):
    """Program (n, s): output rows [n·bn, (n+1)·bn), heads [s·steps·hk, (s+1)·steps·hk) of K (x, z viewed
    [1, H, d], w [N, H, d]): Σ over its tiles of w[rows, heads, :] · gated_rms_norm(x[heads]) in `dt`, one partial
    sum."""
    from jax.experimental import pallas as pl

    n, s = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(pl.multiple_of(n * bn, bn), bn)
    g = g_ref[...].astype(F32)  # [d]

    def body(i, acc):
        heads = pl.ds(pl.multiple_of((s * steps + i) * hk, hk), hk)
        x = x_ref[0, heads, :].astype(F32)  # [hk, d]
        r = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps)  # the reference's mean over the head
        xn = (g[None, :] * x) * r[:, None] * jax.nn.sigmoid(z_ref[0, heads, :].astype(F32))
        xn = xn.astype(dt).astype(w_ref.dtype).astype(F32)
        return acc + w_ref[rows, heads, :].astype(F32) * xn[None]
    acc = _loop(steps, body, jnp.zeros((bn, hk, d), F32), unroll)
    o_ref[s, 0, rows] = jnp.sum(jnp.sum(acc, axis=2), axis=1)


def gnorm_reference(x_BK: jax.Array, z_BK: jax.Array, norm_w: jax.Array, eps: float, w: jax.Array, dt,
                    config: Config | None = None, only_where_faster: bool = True) -> jax.Array:
    """fp32 [B, N] = gated_rms_norm(x; norm_w, z) per head of d = len(norm_w) values, cast to `dt`, @ W^T (W [N, K]):
    what KDA's decode computes between its core and o_proj through XLA."""
    B, K = x_BK.shape
    d = norm_w.shape[0]
    xn = gated_rms_norm(x_BK.reshape(B, K // d, d), norm_w, z_BK.reshape(B, K // d, d), eps).reshape(B, K)
    return reference(xn.astype(dt), w)


# gemv_gnorm's tiling for a step A/B or a sweep (scripts/gpu/gnorm_sweep.py; step_with_kernel.py `gemv:GNORM_SPLITS=8`):
# 0 keeps config_for's value.
GNORM_SPLITS = 0
GNORM_BN = 0
GNORM_WARPS = 0


def gnorm_config(N: int, K: int, d: int) -> Config:
    """The GEMV's tiling at (1, N, K) with tiles of whole heads (bk a multiple of d)."""
    c = config_for(1, N, K)
    return dataclasses.replace(c, bk=max(c.bk, d), splits=GNORM_SPLITS or c.splits, bn=GNORM_BN or c.bn,
                               num_warps=GNORM_WARPS or c.num_warps)


def gemv_gnorm(x_BK: jax.Array, z_BK: jax.Array, norm_w: jax.Array, eps: float, w: jax.Array, dt,
               config: Config | None = None, interpret: bool = False, only_where_faster: bool = True) -> jax.Array:
    """The same function as `gnorm_reference`, the norm in the GEMV's prologue: fp32 [1, N]."""
    from jax.experimental import pallas as pl

    N, K = w.shape
    d = norm_w.shape[0]
    c = config or gnorm_config(N, K, d)
    hk = c.bk // d
    H = K // d
    steps = H // c.splits // hk
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    p = pl.pallas_call(
        functools.partial(_gnorm_kernel, bn=c.bn, hk=hk, d=d, steps=steps, eps=float(eps), dt=jnp.dtype(dt),
                          unroll=c.unroll),
        grid=(N // c.bn, c.splits), in_specs=[any_] * 4, out_specs=any_,
        out_shape=jax.ShapeDtypeStruct((c.splits, 1, N), F32), interpret=interpret, name="gemv_gnorm",
        **triton_params(c.num_warps, c.num_stages, interpret),
    )(x_BK.reshape(1, H, d), z_BK.reshape(1, H, d), norm_w, w.reshape(N, H, d))
    return add_splits(p)


# (N, K, d) where the step was measured with the gated norm in o_proj's prologue (on an H200, 2026-12-02, sixth
# session, scripts/gpu/ab_call.sh, the 48B step at B = 1: 2471.6 us with it against 2470.9 without in the same call,
# 357 launch ops against 391; with mla_decode_uv too 2462.6 us and 336): even in time, 34 fewer launches; auto takes
# it only there.
GNORM_MEASURED: set[tuple[int, int, int]] = {(2304, 4096, 128)}


def gnorm_fits(x_BK, z_BK, norm_w, eps: float, w, dt, config: Config | None = None, only_where_faster: bool = True,
               **_) -> str | None:
    """Why this call does not suit `gemv_gnorm` (None: it does): one row of x and z [1, K], K whole heads of a
    power-of-two d = len(norm_w), bf16 [N, K] weights, tiles of whole heads that divide the shape; `auto` only
    where the step was measured with it (`GNORM_MEASURED`: even in time, fewer kernels)."""
    if x_BK.ndim != 2 or x_BK.shape[0] != 1 or z_BK.shape != x_BK.shape or w.ndim != 2:
        return (f"gemv_gnorm kernel takes one row of x and z [1, K] and a 2-D weight, got {x_BK.shape}, "
                f"{getattr(z_BK, 'shape', None)}, {w.shape}")
    N, K = w.shape
    d = norm_w.shape[0] if norm_w.ndim == 1 else 0
    if K != x_BK.shape[1] or not pow2(d) or K % d:
        return (f"gemv_gnorm kernel: K = {x_BK.shape[1]} whole heads of a power-of-two d (the norm weight), got w "
                f"{w.shape}, norm {norm_w.shape}")
    if w.dtype != jnp.bfloat16:
        return f"gemv_gnorm kernel streams bf16 weights, got {w.dtype}"
    c = config or gnorm_config(N, K, d)
    if c.dot or not (pow2(c.bn) and pow2(c.bk)) or c.bn < 8 or c.bk % d or N % c.bn or K % (c.splits * c.bk):
        return (f"gemv_gnorm kernel: tiles of bn {c.bn} rows (a power of two >= 8 dividing N {N}) by bk {c.bk} "
                f"columns (a power of two of whole heads of {d}), {c.splits} splits dividing K {K}, element-wise "
                "(no dot)")
    if only_where_faster and (N, K, d) not in GNORM_MEASURED:
        return (f"gemv_gnorm kernel: the step at (N, K, d) = {(N, K, d)} was not measured with it on an H200 "
                "(kernels='on' runs it)")
    return None


# Proven on an H200 (2026-12-02, sixth session): compiled tests at the 48B's and K3's o_proj shapes
# (tests/test_gemv.py::test_gemv_gnorm_on_gpu), and the 48B step (GNORM_MEASURED).
register(Kernel("gemv_gnorm", gnorm_reference, gemv_gnorm, platforms=("gpu",), fits=gnorm_fits,
                measured="B=1, Kimi-Linear-48B TP 1 KDA o_proj: the step even with it (2471.6 vs 2470.9 us), 34 fewer "
                         "kernels (H200, jax 0.11.2, 2026-12-02)"))
