"""The routed experts of a MoE decode step as two Pallas kernels over the *distinct* selected
experts, beside their jnp reference `experts_partial` (and the MXFP4 format and GLU math it uses).

The reference gathers one weight matrix per (token, slot): at batch B with k experts per token it
reads B·k matrices, duplicates included.  Here the B·k choices are reduced to U = min(E, B·k)
distinct experts first (`plan`), and each selected expert's rows are read once for the whole batch:

    kernel 1 (gate-up, activation fused)   a[u, b] = act(W1_u z_b, W3_u z_b)      [U, B, I]
    kernel 2 (down)                        y[u, b] = W2_u a[u, b]                  [U, B, L]
    out_b = Σ_u coef[u, b] · y[u, b]        coef: the routing weight where token b chose expert u, else 0

Weights are dense (the model dtype) or MXFP4 (`MXFP4` below); MXFP4 rows are
dequantised in registers (E2M1 nibble -> value by arithmetic, times the E8M0 scale written as a
float exponent) and never exist dequantised in memory.  Products and sums are float32, as in the
reference; the sums run in a different order, so results agree to float32 rounding (tests:
tests/test_kernels.py).  A grid program owns `Config.bo` output rows of one distinct expert and walks
the input columns in chunks of whole 32-column scale groups; padded slots of `plan` (expert id -1)
write zeros and read nothing.  `Config` holds the tiling and the E2M1 decode (by selects, or by building
the scaled float's bits), for the sweep that looks for the configuration that beats XLA.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxk3.config import MXFP4_GROUP as G32
from jaxk3.config import KimiK3Config
from jaxk3.kernels.registry import Kernel, pow2, register, triton_params

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernels' tiling and MXFP4 decode (scripts/gpu/moe_experts_sweep.py times them against XLA).
    The default is the configuration measured at 0.58x XLA (docs/PERF.md, issue 22)."""
    bo: int = 16  # output rows per grid program
    groups: int = 8  # scale groups (32 columns each) per loop step, at most (the largest power of two dividing)
    decode: str = "select"  # E2M1 -> float: "select" (compares and selects) or "bits" (the float's bits built)
    num_warps: int | None = None  # None: Pallas's default (no compiler params)
    num_stages: int | None = None


# ---------------------------------------------------------------- the jnp math (reference and CPU path)
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MXFP4:
    """A stack of MXFP4 matrices W [E, O, In] (compressed-tensors `mxfp4-pack-quantized`, jaxk3.mxfp4):
    `packed` uint8 [E, O, In/2] (byte j: low nibble = column 2j, high = 2j+1) and `scale` uint8
    [E, O, In/32] (E8M0, bias 127), sharded alike (a split of In splits whole scale groups)."""
    packed: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:  # the logical [E, O, In]
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])


def glu(a: jax.Array, b: jax.Array, act: str, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    """Gated activation in fp32: SiLU-GLU `silu(a)*b`, or SiTU-GLU (docs/SPEC.md §3.5):
    `β1·tanh(a/β1)·sigmoid(a) · β2·tanh(b/β2)`."""
    a, b = a.astype(F32), b.astype(F32)
    if act == "silu":
        return jax.nn.silu(a) * b
    if act == "situ":
        return beta * jnp.tanh(a / beta) * jax.nn.sigmoid(a) * (linear_beta * jnp.tanh(b / linear_beta))
    raise ValueError(f"hidden_act: unknown activation {act!r}")


def act(cfg: KimiK3Config, a: jax.Array, b: jax.Array) -> jax.Array:
    """The experts' GLU activation as the config names it (SiTU-GLU for K3, SiLU-GLU for Kimi-Linear)."""
    return glu(a, b, cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)


def e8m0_scales(scale_u8: jax.Array) -> jax.Array:
    """E8M0 bytes -> float32 2**(s - 127), exactly: the exponent field written directly (s >= 1), and
    2**-127 (a subnormal) for s = 0.  Scale 255 (NaN) is refused at load and never generated."""
    s = scale_u8.astype(jnp.int32)
    return jnp.where(s == 0, jnp.float32(2.0 ** -127), lax.bitcast_convert_type(s << 23, F32))


def dequantize(w: MXFP4) -> jax.Array:
    """float32 [..., O, In] from packed [..., O, In/2] and scale [..., O, In/32]: every value exact
    (3 significant bits times a power of two), equal to jaxk3.mxfp4.dequantize."""
    table = jnp.asarray(_E2M1_VALUES)
    codes = jnp.stack([w.packed & 0x0F, w.packed >> 4], axis=-1)  # [..., O, In/2, 2]: column 2j, 2j+1
    vals = table[codes.astype(jnp.int32)].reshape(*w.scale.shape, G32)
    return (vals * e8m0_scales(w.scale)[..., None]).reshape(*w.packed.shape[:-1], -1)


_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def expert_rows(w: jax.Array | MXFP4, ids: jax.Array) -> jax.Array:
    """The selected experts' matrices in float32, [*ids.shape, O, In] (dense: the stored values;
    MXFP4: dequantised from the selected experts' bytes only)."""
    if isinstance(w, MXFP4):
        return dequantize(MXFP4(jnp.take(w.packed, ids, axis=0), jnp.take(w.scale, ids, axis=0)))
    return jnp.take(w, ids, axis=0).astype(F32)


def compute_dtype(w, z: jax.Array):
    """The experts' input dtype: the dense experts' dtype, or the activations' for MXFP4."""
    return z.dtype if isinstance(w.experts_w2, MXFP4) else w.experts_w2.dtype


def experts_partial(cfg: KimiK3Config, w, z_BL: jax.Array, w_Bk: jax.Array, ids_Bk: jax.Array
                    ) -> jax.Array:
    """Σ_k w_k · W2_k act(W1_k z, W3_k z) over the local intermediate shard: fp32 [B, L] partial
    (`w`: the block's weights, jaxk3.layers.moe.MoEWeights; only the experts are read: w1 and w3, or
    their serving-layout join experts_w13, and w2).

    Each GEMV is written as gather · multiply · sum so that XLA fuses the expert gather into the
    reduction and reads each selected expert's weights once.  As an einsum over `jnp.take(...)`
    the gather is materialised first (a [B, k, I, L] copy written and read again: measured on
    2x H200 as 4.2 GB of extra traffic per K3 decode step at B=1, docs/PERF.md)."""
    dt = compute_dtype(w, z_BL)
    z = z_BL.astype(dt).astype(F32)  # the experts see the compute dtype, as in vLLM

    def gemv(w_EOI: jax.Array | MXFP4, x_BkI: jax.Array) -> jax.Array:  # [B, k, O] = W[ids] @ x, fp32
        return jnp.sum(expert_rows(w_EOI, ids_Bk) * x_BkI[:, :, None, :], axis=-1)

    zk = jnp.broadcast_to(z[:, None, :], (*ids_Bk.shape, z.shape[-1]))
    if getattr(w, "experts_w13", None) is not None:  # the serving layout: w1 | w3 in one read of each expert
        h_Bk2I = gemv(w.experts_w13, zk)
        h1_BkI, h3_BkI = h_Bk2I[..., :h_Bk2I.shape[-1] // 2], h_Bk2I[..., h_Bk2I.shape[-1] // 2:]
    else:
        h1_BkI = gemv(w.experts_w1, zk)
        h3_BkI = gemv(w.experts_w3, zk)
    a_BkI = act(cfg, h1_BkI, h3_BkI).astype(dt).astype(F32)
    y_BkL = gemv(w.experts_w2, a_BkI)
    return jnp.einsum("bkl,bk->bl", y_BkL, w_Bk)


# ---------------------------------------------------------------- the Pallas kernel


def plan(ids_Bk: jax.Array, w_Bk: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(uniq_U int32: the distinct selected experts, then -1 padding; coef_UB fp32: token b's routing
    weight for expert uniq[u], 0 where b did not choose it), U = min(E, B·k)."""
    B, k = ids_Bk.shape
    U = min(num_experts, B * k)
    uniq = jnp.unique(ids_Bk.reshape(-1), size=U, fill_value=-1).astype(jnp.int32)
    hit = ids_Bk[None, :, :] == uniq[:, None, None]  # [U, B, k]
    coef = jnp.sum(jnp.where(hit, w_Bk[None].astype(F32), 0.0), axis=-1)
    return uniq, coef


def _groups(cols: int, most: int) -> int:
    """Scale groups per loop step: the largest power of two <= `most` dividing cols / 32."""
    g = most
    while (cols // G32) % g:
        g //= 2
    return g


def _e2m1(code: jax.Array) -> jax.Array:
    """int32 E2M1 codes (0..15) -> float32 values, by arithmetic (no table): bit 3 sign, bits 1-2
    exponent, bit 0 mantissa; exponent 0 is the subnormal 0 / 0.5."""
    e, m = (code >> 1) & 3, (code & 1).astype(F32)
    p2 = jnp.where(e == 1, 1.0, jnp.where(e == 2, 2.0, 4.0)).astype(F32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * p2)
    return jnp.where(code >= 8, -mag, mag)


def _e2m1_scaled_bits(code: jax.Array, s: jax.Array) -> jax.Array:
    """int32 E2M1 codes (0..15) times 2**(s - 127) for int32 E8M0 bytes s (broadcast per scale group), as
    float32 built from its bits: the value (1 + m/2)·2^(e−1) (e = 1..3) or m/2 (e = 0) times 2^(c − 127) is
    the float32 of exponent field e + c − 1 (c − 1 for 0.5) and mantissa m·2^22, normal for c in [2, 252].
    So with c = s clamped there, one product by the group's power of two 2^(s − c) (exactly 1.0 for every
    scale real checkpoints hold; 2^-2, 2^-1, 2, 4 and +inf at s = 0, 1, 253, 254, 255) gives the select
    decode's value bit for bit (both are one rounding of the same exact product): no select chain per
    weight, one multiply as the select decode has."""
    e, m = (code >> 1) & 3, code & 1
    c = jnp.clip(s, 2, 252)
    field = jnp.where(e == 0, c - 1, e + c - 1)
    bits = jnp.where((e == 0) & (m == 0), 0, (field << 23) | jnp.where(e == 0, 0, m << 22)) | ((code >> 3) << 31)
    # per group: 2^(s − c) as the reference's own scale times 2^(127 − c), so that a platform that flushes
    # the subnormal 2^-127 (s = 0) to zero flushes it here too
    rest = _scale(s) * lax.bitcast_convert_type((254 - c) << 23, F32)
    return lax.bitcast_convert_type(bits, F32) * rest


def _scale(s_u8: jax.Array) -> jax.Array:
    """E8M0 bytes -> float32 2**(s - 127), exactly (as moe.e8m0_scales; 0 -> 2**-127)."""
    s = s_u8.astype(jnp.int32)
    return jnp.where(s == 0, F32(2.0 ** -127), lax.bitcast_convert_type(s << 23, F32))


def _rows(w, e, j: jax.Array, c: jax.Array, g: int, packed: bool, cf: Config):
    """The (lo, hi) or (vals,) float32 blocks of expert e's rows [j·bo, (j+1)·bo), scale groups
    [c·g, (c+1)·g): MXFP4 -> two [bo, g, 16] blocks (even and odd columns), dense -> one [bo, g, 32]."""
    rows, grp = pl_ds(j * cf.bo, cf.bo), pl_ds(c * g, g)
    if not packed:
        return (w[0][e, rows, grp, :].astype(F32),)
    codes = w[0][e, rows, grp, :].astype(jnp.int32)  # [bo, g, 16] bytes
    if cf.decode == "bits":
        s = w[1][e, rows, grp].astype(jnp.int32)[:, :, None]  # [bo, g, 1]
        return _e2m1_scaled_bits(codes & 15, s), _e2m1_scaled_bits(codes >> 4, s)
    s = _scale(w[1][e, rows, grp])[:, :, None]  # [bo, g, 1]
    return _e2m1(codes & 15) * s, _e2m1(codes >> 4) * s


def _dot(blocks, xs) -> jax.Array:
    """Σ over a chunk of blocks[i] [bo, g, n] · xs[i] [g, n] -> [bo]."""
    acc = None
    for wb, xb in zip(blocks, xs):
        t = jnp.sum(jnp.sum(wb * xb[None], axis=2), axis=1)
        acc = t if acc is None else acc + t
    return acc


def pl_ds(start, size):
    from jax.experimental import pallas as pl

    return pl.ds(start, size)


def _x_chunks(x_ref, lead: tuple, c, g: int, packed: bool, dtype):
    """The input columns of chunk c for one token: (even, odd) [g, 16] (MXFP4) or ([g, 32],), in the
    activations' dtype then float32 (the reference's cast)."""
    grp = pl_ds(c * g, g)
    if packed:
        return tuple(r[(*lead, grp, slice(None))].astype(dtype).astype(F32) for r in x_ref)
    return (x_ref[0][(*lead, grp, slice(None))].astype(dtype).astype(F32),)


def _gate_up_kernel(uniq_ref, *refs, B: int, g: int, chunks: int, packed: bool, act, dtype, cf: Config):
    from jax.experimental import pallas as pl

    nx, nw = (2, 2) if packed else (1, 1)
    x_ref, w1, w3, a_ref = refs[:nx], refs[nx:nx + nw], refs[nx + nw:nx + 2 * nw], refs[-1]
    u, j = pl.program_id(0), pl.program_id(1)
    e = uniq_ref[u]

    @pl.when(e >= 0)
    def _():
        def body(c, acc):
            b1, b3 = _rows(w1, e, j, c, g, packed, cf), _rows(w3, e, j, c, g, packed, cf)
            out = []
            for b in range(B):
                xs = _x_chunks(x_ref, (b,), c, g, packed, dtype)
                out += [acc[2 * b] + _dot(b1, xs), acc[2 * b + 1] + _dot(b3, xs)]
            return tuple(out)

        acc = lax.fori_loop(0, chunks, body, tuple(jnp.zeros((cf.bo,), F32) for _ in range(2 * B)))
        for b in range(B):
            a_ref[b, :] = act(acc[2 * b], acc[2 * b + 1]).astype(a_ref.dtype)

    @pl.when(e < 0)
    def _():
        for b in range(B):
            a_ref[b, :] = jnp.zeros((cf.bo,), a_ref.dtype)


def _down_kernel(uniq_ref, *refs, B: int, g: int, chunks: int, packed: bool, dtype, cf: Config):
    from jax.experimental import pallas as pl

    nx = 2 if packed else 1
    x_ref, w2, y_ref = refs[:nx], refs[nx:-1], refs[-1]
    u, j = pl.program_id(0), pl.program_id(1)
    e = uniq_ref[u]

    @pl.when(e >= 0)
    def _():
        def body(c, acc):
            blocks = _rows(w2, e, j, c, g, packed, cf)
            return tuple(acc[b] + _dot(blocks, _x_chunks(x_ref, (u, b), c, g, packed, dtype)) for b in range(B))

        acc = lax.fori_loop(0, chunks, body, tuple(jnp.zeros((cf.bo,), F32) for _ in range(B)))
        for b in range(B):
            y_ref[b, :] = acc[b]

    @pl.when(e < 0)
    def _():
        for b in range(B):
            y_ref[b, :] = jnp.zeros((cf.bo,), F32)


def _weight_views(w) -> tuple[list[jax.Array], bool]:
    """A weight stack as grouped views: MXFP4 -> ([packed [E, O, In/32, 16], scale [E, O, In/32]], True),
    dense -> ([w [E, O, In/32, 32]], False).  Reshapes of contiguous trailing dims: no copies."""
    if isinstance(w, MXFP4):
        E, O, half = w.packed.shape
        return [w.packed.reshape(E, O, half // 16, 16), w.scale], True
    E, O, In = w.shape
    return [w.reshape(E, O, In // G32, G32)], False


def _x_views(x: jax.Array, packed: bool) -> list[jax.Array]:
    """Inputs [..., In] as [..., In/32, 16] even and odd columns (MXFP4) or [..., In/32, 32]."""
    v = x.reshape(*x.shape[:-1], x.shape[-1] // G32, G32)
    return [v[..., 0::2], v[..., 1::2]] if packed else [v]


def experts(cfg, w, z_BL: jax.Array, w_Bk: jax.Array, ids_Bk: jax.Array, interpret: bool = False,
            config: Config | None = None) -> jax.Array:
    """The same function as the reference: fp32 [B, L] = Σ_k w_k · W2_k act(W1_k z, W3_k z) over the
    local intermediate shard."""
    from jax.experimental import pallas as pl

    cf = config or Config()
    kw = {} if cf.num_warps is None else triton_params(cf.num_warps, cf.num_stages or 1, interpret)

    B0 = z_BL.shape[0]
    B = 1 << (B0 - 1).bit_length()  # Triton blocks are powers of two: pad the batch with zero rows
    z_BL = jnp.pad(z_BL, ((0, B - B0), (0, 0)))
    E, I, L = w.experts_w1.shape
    dt = compute_dtype(w, z_BL)
    uniq, coef = plan(ids_Bk, w_Bk, E)
    U = uniq.shape[0]
    w1v, packed = _weight_views(w.experts_w1)
    w3v, _ = _weight_views(w.experts_w3)
    w2v, _ = _weight_views(w.experts_w2)
    act = functools.partial(glu, act=cfg.hidden_act, beta=cfg.activation_situ_beta,
                            linear_beta=cfg.activation_situ_linear_beta)
    whole = [pl.BlockSpec(memory_space=pl.ANY)]  # raw refs: each program indexes its expert's rows itself

    g1 = _groups(L, cf.groups)
    xs = _x_views(z_BL.astype(dt), packed)
    a = pl.pallas_call(
        functools.partial(_gate_up_kernel, B=B, g=g1, chunks=L // (G32 * g1), packed=packed, act=act, dtype=dt,
                          cf=cf),
        out_shape=jax.ShapeDtypeStruct((U, B, I), dt), grid=(U, I // cf.bo),
        in_specs=whole * (1 + len(xs) + 2 * len(w1v)),
        out_specs=pl.BlockSpec((None, B, cf.bo), lambda u, j: (u, 0, j)), interpret=interpret, **kw,
    )(uniq, *xs, *w1v, *w3v)

    g2 = _groups(I, cf.groups)
    av = _x_views(a, packed)
    y = pl.pallas_call(
        functools.partial(_down_kernel, B=B, g=g2, chunks=I // (G32 * g2), packed=packed, dtype=dt, cf=cf),
        out_shape=jax.ShapeDtypeStruct((U, B, L), F32), grid=(U, L // cf.bo),
        in_specs=whole * (1 + len(av) + len(w2v)),
        out_specs=pl.BlockSpec((None, B, cf.bo), lambda u, j: (u, 0, j)), interpret=interpret, **kw,
    )(uniq, *av, *w2v)
    return jnp.einsum("ubl,ub->bl", y[:, :B0], coef)


reference = experts_partial


def fits(cfg, w, z_BL, w_Bk, ids_Bk, config: Config | None = None, **_) -> str | None:
    cf = config or Config()
    if not (pow2(cf.bo) and pow2(cf.groups)):
        return f"moe_experts kernel needs bo and groups powers of two (Triton blocks), got {cf.bo}, {cf.groups}"
    if cf.decode not in ("select", "bits"):
        return f"moe_experts kernel: decode must be 'select' or 'bits', got {cf.decode!r}"
    if w.experts_w1 is None:
        return "moe_experts kernel reads the checkpoint layout's experts_w1 / experts_w3 (not the serving layout's w13)"
    E, I, L = w.experts_w1.shape
    if z_BL.ndim != 2 or z_BL.shape[0] > 16:
        return f"moe_experts kernel is for decode (at most 16 tokens), got z {z_BL.shape}"
    for name, rows, cols in (("w1/w3", I, L), ("w2", L, I)):
        if rows % cf.bo or cols % G32:
            return (f"moe_experts kernel needs {name} rows a multiple of {cf.bo} and columns a multiple of {G32}, "
                    f"got [{rows}, {cols}]")
    return None


register(Kernel("moe_experts", reference, experts, platforms=("gpu",), fits=fits,
                unproven="slower than XLA on an H200 (docs/PERF.md, issue 22): MXFP4 experts at K3's TP 2 share, 64 "
                         "experts, B 1: the kernel 304 us vs XLA's fused dequantisation 175 us, though its compiled "
                         "real-dims tests pass (tests/test_kernels_real.py, test_moe_experts_kernel_on_gpu); kept "
                         "for a rewrite for MXFP4 bandwidth",
                measured="MXFP4, K3 TP 2 share, 64 experts, B=1: 0.58x XLA's fused dequantisation (304 vs 175 us; "
                         "H200, jax 0.11.2, issue 22)"))
