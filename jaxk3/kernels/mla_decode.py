"""Absorbed MLA decode attention over the latent cache, split over the context (flash-decoding),
as a Pallas kernel beside its jnp reference `latent_attention`.

The reference scores every cache slot of every head at once ([B, H, S] scores, a softmax, a second
pass over the cache); at long contexts XLA runs that as a few kernels with little parallelism over S.
Here the cache's S slots are cut into parts of `split` slots, and a grid program per (row, head
group, part) walks its part in blocks of `bs` slots with an online softmax (running max m, sum l,
weighted sum acc of c_kv), reading each cache entry once for its head group; slots past the row's
length are masked out of the loads (never read) and out of the softmax.  A short jnp step merges
the parts (log-sum-exp).

The dots run on the tensor cores: bf16 operands, float32 accumulation.  The cache tile is used
as stored (bf16); q_latent and q_pe are rounded to bf16 once (in the wrapper), the probabilities p
per block (after the exp, before the p·c_kv dot).  The softmax statistics (m, l: l sums the fp32
p), the rescaling of acc and the merge stay float32.  The rounding of q and p (unit roundoff 2^-8)
is the only departure from the float32 reference; its size is worked out in tests/test_kernels.py
(test_mla_decode_kernel_matches_reference).  The cache must be bf16 (`fits`).

Tiles (`tiles`): a head group of Hb = 16 heads (the dots' M; padded heads score 0 and are dropped)
and bs = 32 slots per step, so the three dots are [16, R]·[R, 32], [16, P]·[P, 32] and
[16, 32]·[32, R]: M, N, K >= 16 and multiples of 16 (tl.dot's minimum) at R = 512, P = 64.  Shared
memory (`smem_estimate`, the fp32 formula that reproduced 442,624 B for the first 64 x 64 tiling on
an H200, with 2-byte tiles; an estimate until the GPU run, which names the real figure where a
tiling exceeds it): 89,344 B at every preset (Hb 16, bs 32, R 512, P 64), under the 232,448 B a
block may have; `fits` names a tiling that cannot fit, and one whose fp32 accumulator [Hb, R] would
not fit in the registers of `num_warps` warps.  The context split halves (from 1024) until there
are >= MIN_PROGRAMS = 256 programs (about 2 per SM of an H200's 132) or a part is down to two blocks
(at 4K context: 384 programs at K3 TP 1, 256 at TP 2 and Kimi-Linear for B = 8, 128 at Kimi-Linear
for B = 1, 64 at K3 TP 8; at 32K, Kimi-Linear: 256 for B = 1, 512 for B = 8).  The partial sums
this writes ([Hb, R] fp32 per program, up to 17 MB, 2.7x the cache bytes at K3 TP 1, B = 1) stay
mostly in the H200's L2 for the merge, and parallelism is what the latency-bound B = 1 step lacks.
scripts/gpu/mla_sweep.py times the split, the grid's order and the merge's loop at the 48B's MLA:
the split is what matters (2026-12-03: at 32K, B = 1, 48.0-56.4 us a call with splits of 256 or 512
slots against 62.3-77.3 with 128; at 4K, B = 8, 41.5-43.4 with 256 against 47.5 with 128), where 264
(2 per SM, the rule before) halved the split once more at those two shapes; the order and the merge's pipelining moved nothing beyond the
run's spread, so they stay at their defaults (ORDER, MERGE_PC, MERGE_STAGES).

Measured on an H200 (2026-12-01, docs/PERF.md), the former float32 version: correct at every preset
shape but its fp32 dots lowered to CUDA-core FMAs, 3.3 ms against XLA's 33 us at K3 TP 1, B = 1,
4K context.  This bf16 tensor-core version beats XLA's path at every preset shape (the registry's
`measured`; its compiled tests, tests/test_kernels_real.py, last ran on an H200 on 2026-12-02).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels.registry import Kernel, dot_nt, pow2, register, triton_params

F32 = jnp.float32
BF16 = jnp.bfloat16
BLOCK_S = 32  # cache slots per inner step (default; `tiles`): N of the score dots, K of p·c_kv
# heads per grid program: M of the dots (tl.dot needs >= 16).  32 (the 48B's heads in one group, the latent cache read
# once instead of twice) compiled and ran at the 48B's dims and was slower alone and in the step at 4K and 32K on an
# H100 (docs/PERF.md, thirty-first session: the 32K step 3150.7 against 3057.7 us); `block_h` keeps it for sweeps.
BLOCK_H = 16
SPLIT = 1024  # at most this many cache slots per grid program (parts = S / split)
NEG = -1e30  # a finite "minus infinity": exp(NEG - m) is 0 without inf - inf
ORDER = "gp"  # the attention grid's order: (row, head group, part) "gp" or (row, part, head group) "pg" (`_parts`)
SMEM_BYTES = 232_448  # shared memory a block may use on an H100/H200 (sm_90)
MIN_PROGRAMS = 256  # aim for ~2 programs per SM (132 SMs): the context split shrinks until there are
ACC_REGS = 128  # at most this many 32-bit registers per thread for the fp32 accumulator [Hb, R]


def warps(Hb: int, R: int, num_warps: int | None = None) -> int:
    """The attention kernel's warps: `num_warps` where given, else enough that its fp32 accumulator [Hb, R] takes at
    most half of ACC_REGS registers a thread (4 for 16 heads of 512, 8 for 32), at least 4."""
    if num_warps is not None:
        return num_warps
    w = 4
    while Hb * R // (32 * w) > ACC_REGS // 2:
        w *= 2
    return w


def smem_estimate(Hb: int, bs: int, R: int, P: int, itemsize: int = 2) -> int:
    """Shared memory the Triton lowering asks for: itemsize x (q_latent [Hb, R] + the cache tile
    [bs, R] staged twice (once per dot) + q_pe [Hb, P] + k_pe [bs, P] + p [Hb, bs]) + 256.  With
    itemsize 4 (the former fp32 tiles) it reproduces the 442,624 B that Hb = 64, bs = 64, R = 512,
    P = 64 asked for on an H200; the kernel's tiles are bf16 (itemsize 2): 89,344 B at Hb 16, bs 32."""
    return itemsize * (Hb * R + 2 * bs * R + Hb * P + bs * P + Hb * bs) + 256


def tiles(B: int, H: int, S: int, R: int, P: int, block_h: int | None = None, block_s: int | None = None,
          split: int | None = None) -> tuple[int, int, int]:
    """(Hb, bs, split): the head group, the slots per inner step, the slots per grid program."""
    Hb = block_h or BLOCK_H
    bs = block_s or BLOCK_S
    if split is None:
        G = -(-H // Hb)
        split = min(SPLIT, S)
        # halve the split for parallelism (>= MIN_PROGRAMS programs) while a part keeps >= 2 blocks
        while (split // 2 >= 2 * bs and split % 2 == 0 and S % (split // 2) == 0 and (split // 2) % bs == 0
               and B * G * (S // split) < MIN_PROGRAMS):
            split //= 2
    return Hb, bs, split


def latent_attention(ql_BHR: jax.Array, qpe_BHP: jax.Array, kv_BSR: jax.Array, length_B: jax.Array,
                     scale: float) -> jax.Array:
    """Absorbed decode attention over the latent cache, fp32 [B, H, R]: every head's softmax over slots
    t <= length_B of (ql·c_kv_t + q_pe·k_pe_t)·scale, applied to c_kv.  The `mla_decode` kernel's
    reference (R = kv_lora_rank: the first R of each cache entry are c_kv, the rest k_pe)."""
    S, R = kv_BSR.shape[1], ql_BHR.shape[-1]
    c_BSR = kv_BSR.astype(F32)
    score_BHS = (jnp.einsum("bhr,bsr->bhs", ql_BHR, c_BSR[..., :R])
                 + jnp.einsum("bhp,bsp->bhs", qpe_BHP, c_BSR[..., R:])) * scale
    mask_BS = jnp.arange(S)[None, :] <= length_B[:, None]
    score_BHS = jnp.where(mask_BS[:, None, :], score_BHS, -jnp.inf)
    p_BHS = jax.nn.softmax(score_BHS, axis=-1)
    return jnp.einsum("bhs,bsr->bhr", p_BHS, c_BSR[..., :R])


def _kernel(len_ref, ql_ref, qpe_ref, kv_ref, m_ref, l_ref, acc_ref, *, R: int, P: int, S: int, split: int,
            scale: float, BLOCK_S: int, order: str):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b = pl.program_id(0)
    hg, part = (pl.program_id(1), pl.program_id(2)) if order == "gp" else (pl.program_id(2), pl.program_id(1))
    end = jnp.minimum(len_ref[b] + 1, S)  # this row's slots are [0, end)
    ql, qpe = ql_ref[b, hg], qpe_ref[b, hg]  # bf16 [Hb, R], [Hb, P]
    Hb = ql.shape[0]
    start = part * split
    # only blocks that hold a slot below `end`: every block walked has >= 1 valid slot, so m is finite after it
    steps = jnp.clip((end - start + BLOCK_S - 1) // BLOCK_S, 0, split // BLOCK_S)

    def body(i, carry):
        m, l, acc = carry
        pos = start + i * BLOCK_S
        ok = pos + jnp.arange(BLOCK_S) < end  # [BS]
        # slots past the length are not read (masked loads give 0): they may hold anything, NaN included
        c = plgpu.load(kv_ref.at[b, pl.ds(pos, BLOCK_S), pl.ds(0, R)], mask=ok[:, None], other=0.0)  # bf16 [BS, R]
        kpe = plgpu.load(kv_ref.at[b, pl.ds(pos, BLOCK_S), pl.ds(R, P)], mask=ok[:, None], other=0.0)  # [BS, P]
        s = (dot_nt(ql, c) + dot_nt(qpe, kpe)) * scale  # fp32 [Hb, BS]
        s = jnp.where(ok[None, :], s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])  # fp32; masked slots: exp(NEG - m_new) = 0
        corr = jnp.exp(m - m_new)
        pc = jax.lax.dot_general(p.astype(c.dtype), c, (((1,), (0,)), ((), ())), preferred_element_type=F32)
        return m_new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + pc

    init = (jnp.full((Hb,), NEG, F32), jnp.zeros((Hb,), F32), jnp.zeros((Hb, R), F32))
    m, l, acc = jax.lax.fori_loop(0, steps, body, init)
    m_ref[b, hg, part] = m
    l_ref[b, hg, part] = l
    acc_ref[b, hg, part] = acc


def mla_decode(ql_BHR, qpe_BHP, kv_BSR, length_B, scale: float, interpret: bool = False, block_h: int | None = None,
               block_s: int | None = None, split: int | None = None, num_warps: int | None = None,
               num_stages: int = 2, order: str | None = None) -> jax.Array:
    """The reference's function with bf16 dot operands (q, p; the bf16 cache): fp32 [B, H, R]."""
    m, l, acc = _parts(ql_BHR, qpe_BHP, kv_BSR, length_B, scale, interpret, block_h, block_s, split, num_warps,
                       num_stages, order)
    B, H, R = ql_BHR.shape
    w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))  # parts past the length: m = NEG, weight 0
    out = jnp.sum(w[..., None] * acc, axis=2) / jnp.sum(w * l, axis=2)[..., None]
    return out.reshape(B, -1, R)[:, :H]


def _parts(ql_BHR, qpe_BHP, kv_BSR, length_B, scale: float, interpret: bool, block_h, block_s, split,
           num_warps: int | None,
           num_stages: int, order: str | None = None):
    """The kernel's per-part softmax statistics and sums: m, l [B, G, parts, Hb] and acc [B, G, parts, Hb, R].
    `order` "gp": the grid is (row, head group, part), a head group's parts launched together; "pg": (row, part,
    head group), the head groups of a part together, so that the second reads the part's cache from L2."""
    from jax.experimental import pallas as pl

    B, H, R = ql_BHR.shape
    S, P = kv_BSR.shape[1], qpe_BHP.shape[-1]
    Hb, bs, split = tiles(B, H, S, R, P, block_h, block_s, split)
    G = -(-H // Hb)
    parts = S // split
    order = order or ORDER
    kw = triton_params(warps(Hb, R, num_warps), num_stages, interpret)

    def heads(x):  # [B, H, X] -> bf16 [B, G, Hb, X]; padded heads score 0 and are dropped below
        x = jnp.pad(x.astype(kv_BSR.dtype), ((0, 0), (0, G * Hb - H), (0, 0)))
        return x.reshape(B, G, Hb, x.shape[-1])

    any_ = pl.BlockSpec(memory_space=pl.ANY)
    m, l, acc = pl.pallas_call(
        functools.partial(_kernel, R=R, P=P, S=S, split=split, scale=scale, BLOCK_S=bs, order=order),
        grid=(B, G, parts) if order == "gp" else (B, parts, G),
        in_specs=[any_] * 4, out_specs=[any_] * 3, **kw,
        out_shape=(jax.ShapeDtypeStruct((B, G, parts, Hb), F32), jax.ShapeDtypeStruct((B, G, parts, Hb), F32),
                   jax.ShapeDtypeStruct((B, G, parts, Hb, R), F32)),
        interpret=interpret, name="mla_attention",
    )(length_B.astype(jnp.int32), heads(ql_BHR), heads(qpe_BHP), kv_BSR)
    return m, l, acc


reference = latent_attention


def fits(ql_BHR, qpe_BHP, kv_BSR, length_B, scale, block_h: int | None = None, block_s: int | None = None,
         split: int | None = None, num_warps: int | None = None, **_) -> str | None:
    B, H, R = ql_BHR.shape
    P, S = qpe_BHP.shape[-1], kv_BSR.shape[1]
    if kv_BSR.dtype != BF16:
        return (f"mla_decode kernel runs its dots on the tensor cores over the bf16 cache as stored, got a "
                f"{jnp.dtype(kv_BSR.dtype).name} cache")
    for name, n in (("kv_lora_rank", R), ("qk_rope_head_dim", P)):
        if not pow2(n) or n < 16:
            return f"mla_decode kernel needs {name} a power of two >= 16 (Triton blocks, tl.dot), got {n}"
    Hb, bs, split = tiles(B, H, S, R, P, block_h, block_s, split)
    if "merge_pc" in _ or "merge_stages" in _ or "merge_r" in _:
        return ("mla_decode kernel takes no merge_pc / merge_stages / merge_r (the settings of mla_decode_uv's merge "
                "kernel)")
    if _.get("order") not in (None, "gp", "pg"):
        return f"mla_decode kernel: order must be 'gp' or 'pg' (the grid's head group / part order), got {_['order']!r}"
    if not (pow2(Hb) and pow2(bs)) or Hb < 16 or bs < 16:
        return (f"mla_decode kernel: the head group {Hb} and the slot block {bs} are the dots' M and N/K: powers "
                "of two >= 16 (tl.dot's minimum)")
    if S % bs or S % split or split % bs:
        return (f"mla_decode kernel needs the cache length {S} a multiple of the split {split}, itself a multiple "
                f"of the {bs}-slot block")
    return tile_limits("mla_decode", f"{Hb} heads", Hb, bs, R, P, warps(Hb, R, num_warps), "smaller block_h / block_s",
                       "fewer heads per group or more warps")


def tile_limits(kernel: str, rows: str, m: int, bs: int, R: int, P: int, num_warps: int, smem_hint: str,
                regs_hint: str) -> str | None:
    """Why an m-row x bs-slot tiling of a R + P latent does not fit an sm_90 block (None: it does): the shared
    memory of `smem_estimate`, and the fp32 [m, R] accumulator's registers per thread over `num_warps` warps."""
    need = smem_estimate(m, bs, R, P)
    if need > SMEM_BYTES:
        return (f"{kernel} kernel: {rows} x {bs} slots of a {R}+{P} latent need ~{need:,} B of shared memory, "
                f"more than the {SMEM_BYTES:,} B a block has ({smem_hint})")
    regs = m * R // (32 * num_warps)
    if regs > ACC_REGS:
        return (f"{kernel} kernel: the fp32 accumulator of {rows} x {R} takes {regs} registers per thread with "
                f"{num_warps} warps, over {ACC_REGS} ({regs_hint})")
    return None


# Proven on an H200 (2026-12-01, docs/PERF.md): compiled at the real per-rank dims of K3 TP 1/2/8 and
# Kimi-Linear-48B, B 1 and 8, within its tolerance of the fp32 reference (at most 4.8e-3 of max|ref|),
# and faster than XLA's path at every one of them (1.18-2.51x).
register(Kernel("mla_decode", reference, mla_decode, platforms=("gpu",), fits=fits,
                measured="4K context: 1.18-1.33x XLA at B=1, 2.06-2.51x at B=8, K3 TP 1/2/8 and Kimi-Linear-48B "
                         "(H200, jax 0.11.2, 2026-12-01)"))


# ---------------------------------------------------------------- the parts merged and W_UV applied in one kernel
# After the attention, XLA merges the context parts (their max, the weighted sums and the division: three fusions)
# and applies each head's W_UV ([v, R] rows of kv_b_proj) in a fourth.  `mla_decode_uv` does both in one kernel:
# a program per (row, head, block of `bv` value rows) merges its head's parts over R in chunks of parts and
# multiplies the merged latent by its W_UV rows.


def _merge_uv_kernel(m_ref, l_ref, acc_ref, w_ref, o_ref, *, Hb: int, parts: int, pc: int, bv: int, v0: int):
    from jax.experimental import pallas as pl

    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, hi = h // Hb, h % Hb

    def chunk(c):  # parts [c·pc, (c+1)·pc): pc a power of two dividing parts (which need not be one)
        return pl.ds(pl.multiple_of(c * pc, pc), pc)
    mx = jax.lax.fori_loop(0, parts // pc, lambda c, mx: jnp.maximum(mx, jnp.max(m_ref[b, g, chunk(c), hi])), F32(NEG))

    def body(c, carry):  # the weighted sums of a chunk of parts
        olat, den = carry
        wc = jnp.exp(m_ref[b, g, chunk(c), hi] - mx)  # [pc]
        return (olat + jnp.sum(wc[:, None] * acc_ref[b, g, chunk(c), hi, :], axis=0),
                den + jnp.sum(wc * l_ref[b, g, chunk(c), hi]))
    R = acc_ref.shape[-1]
    olat, den = jax.lax.fori_loop(0, parts // pc, body, (jnp.zeros((R,), F32), F32(0.0)))
    olat = olat / den
    rows = pl.ds(pl.multiple_of(j * bv, bv), bv)
    o_ref[b, h, rows] = jnp.sum(w_ref[h, pl.ds(v0 + j * bv, bv), :].astype(F32) * olat[None, :], axis=1)


def _merge_uv_r_kernel(m_ref, l_ref, acc_ref, w_ref, o_ref, *, Hb: int, rc: int, V: int, v0: int):
    """`MERGE_R` form: program (b, h, c) merges head h's parts over the latent columns [c·rc, (c+1)·rc) only, all
    parts at once (m, l [parts] and acc [parts, rc], each loaded once), and multiplies them by the same columns of
    its W_UV rows [V, rc]: this chunk's share of o[b, h, :] (the wrapper adds the R / rc shares)."""
    from jax.experimental import pallas as pl

    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, hi = h // Hb, h % Hb
    cols = pl.ds(pl.multiple_of(c * rc, rc), rc)
    m = m_ref[b, g, :, hi]  # [parts]
    wgt = jnp.exp(m - jnp.max(m))  # parts past the length: m = NEG, weight 0
    den = jnp.sum(wgt * l_ref[b, g, :, hi])
    olat = jnp.sum(wgt[:, None] * acc_ref[b, g, :, hi, cols], axis=0) / den  # [rc]
    o_ref[c, b, h, :] = jnp.sum(w_ref[h, pl.ds(v0, V), cols].astype(F32) * olat[None, :], axis=1)


def uv_reference(ql_BHR, qpe_BHP, kv_BSR, length_B, scale: float, w_kvb_HXR: jax.Array, v0: int, **_) -> jax.Array:
    """fp32 [B, H, X - v0]: `latent_attention`, then each head's W_UV (rows v0: of its kv_b_proj rows [X, R], in fp32),
    as the MLA layer computes it."""
    olat = latent_attention(ql_BHR, qpe_BHP, kv_BSR, length_B, scale)
    return jnp.einsum("bhr,hvr->bhv", olat, w_kvb_HXR[:, v0:].astype(F32))


UV_BLOCK = 32  # value rows per program of the merge (4 programs per head of 128 values)
MERGE_PC = 8  # at most this many parts per step of the merge's loop (the largest power of two dividing parts)
MERGE_STAGES = 1  # the merge loop's software pipelining (Triton num_stages)
# The merge split over the latent's columns instead of the value rows (`_merge_uv_r_kernel`): 0 off; rc > 0 a program
# per (row, head, rc columns of R) reads its parts' [parts, rc] sums and W_UV's [V, rc] columns once, with no loop,
# where the value-row form reads each head's whole [parts, R] sums once per value block, parts / pc steps one after
# the other (the 48B at 4K: 128 KB in 8 dependent steps a program, the partial sums read 4 times over).  Its output is
# R / rc shares of each o[b, h, :], which the wrapper adds (float32; XLA adds them in a fusion of its own, one more
# launch).  Taken with rc = MERGE_R where the attention leaves at least MERGE_R_MIN_PARTS parts (a call's `merge_r`
# overrides: 0 the value-row form).  Measured on an H100 (2026-12-06, thirtieth session, docs/PERF.md): the 48B B = 1
# step at 32K (128 parts) 3041.8 us against 3087.9, at 4K (64 parts) 2926.8 against 2908.3 / 2914.4; alone
# (scripts/gpu/mla_sweep.py --merge) faster at every shape (4K B = 1 17.8-18.9 us against 20.4-21.5).
MERGE_R = 128
MERGE_R_MIN_PARTS = 128
MERGE_R_WARPS = 8  # the R-split form's warps (its [parts, rc] and [V, rc] tiles: 64 + 64 registers a thread at the 48B's 32K)


def merge_columns(parts: int, R: int, V: int, merge_r: int | None = None) -> int:
    """The R-split merge's latent columns a program (0: the value-row form) for a merge of `parts` parts into V value
    rows: `merge_r` where given (at most R; `uv_fits` names one that cannot run), else MERGE_R (halved while its [parts,
    rc] and [V, rc] tiles together take more than ACC_REGS registers a thread) from MERGE_R_MIN_PARTS parts up, where
    they are powers of two, else 0."""
    if merge_r is not None:
        return min(merge_r, R) if isinstance(merge_r, int) and merge_r > 0 else merge_r
    rc = min(MERGE_R, R)
    while rc > 16 and _merge_regs(parts, V, rc) > ACC_REGS:
        rc //= 2
    if parts < MERGE_R_MIN_PARTS or not rc or _merge_r_problem(parts, V, rc):
        return 0
    return rc


def _merge_regs(parts: int, V: int, rc: int) -> int:
    """Registers a thread of the R-split merge's two float32 tiles, [parts, rc] and [V, rc], live together."""
    return (parts + V) * rc // (32 * MERGE_R_WARPS)


def _merge_r_problem(parts: int, V: int, rc: int) -> str | None:
    """Why the R-split merge cannot run with rc > 0 columns a program (None: it can): `merge_columns` falls back to
    the value-row form there, `uv_fits` refuses an explicit `merge_r` with this."""
    if not pow2(rc):
        return f"mla_decode_uv kernel: merge_r must be 0 (off) or a power of two (latent columns a program), got {rc!r}"
    if not (pow2(parts) and pow2(V)):
        return (f"mla_decode_uv kernel: the R-split merge (merge_r {rc}) loads all {parts} parts and {V} value rows at "
                "once: both must be powers of two")
    regs = _merge_regs(parts, V, rc)
    if regs > ACC_REGS:
        return (f"mla_decode_uv kernel: the R-split merge's [{parts}, {rc}] and [{V}, {rc}] tiles take {regs} "
                f"registers a thread with {MERGE_R_WARPS} warps, over {ACC_REGS} (a smaller merge_r)")
    return None


def mla_decode_uv(ql_BHR, qpe_BHP, kv_BSR, length_B, scale: float, w_kvb_HXR: jax.Array, v0: int,
                  interpret: bool = False, block_v: int = UV_BLOCK, merge_pc: int | None = None,
                  merge_stages: int | None = None, merge_r: int | None = None, **kw) -> jax.Array:
    """`uv_reference`'s function: the attention kernel's parts, then one kernel merging them and applying W_UV (the
    rows v0: of each head's kv_b_proj rows, read in place: no slice of the weight is copied).  `merge_pc`, `merge_stages`:
    the merge loop's parts per step and pipelining (MERGE_PC, MERGE_STAGES); `merge_r`: the merge split over rc latent
    columns instead (MERGE_R; 0 the value-row form); the rest of `kw` is `mla_decode`'s."""
    from jax.experimental import pallas as pl

    B, H, R = ql_BHR.shape
    V = w_kvb_HXR.shape[1] - v0
    m, l, acc = _parts(ql_BHR, qpe_BHP, kv_BSR, length_B, scale, interpret, kw.get("block_h"), kw.get("block_s"),
                       kw.get("split"), kw.get("num_warps"), kw.get("num_stages", 2), kw.get("order"))
    Hb, parts = m.shape[3], m.shape[2]
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    rc = merge_columns(parts, R, V, merge_r)
    if rc:
        shares = pl.pallas_call(
            functools.partial(_merge_uv_r_kernel, Hb=Hb, rc=rc, V=V, v0=v0), grid=(B, H, R // rc),
            in_specs=[any_] * 4, out_specs=any_, out_shape=jax.ShapeDtypeStruct((R // rc, B, H, V), F32),
            interpret=interpret, name="mla_merge_uv_r", **triton_params(MERGE_R_WARPS, 1, interpret))(
                m, l, acc, w_kvb_HXR)
        return jnp.sum(shares, axis=0)
    pc = min(merge_pc or MERGE_PC, parts & -parts)  # a power of two dividing parts
    bv = min(block_v, V)
    return pl.pallas_call(
        functools.partial(_merge_uv_kernel, Hb=Hb, parts=parts, pc=pc, bv=bv, v0=v0), grid=(B, H, V // bv),
        in_specs=[any_] * 4, out_specs=any_, out_shape=jax.ShapeDtypeStruct((B, H, V), F32), interpret=interpret,
        name="mla_merge_uv", **triton_params(4, merge_stages or MERGE_STAGES, interpret))(m, l, acc, w_kvb_HXR)


# the MLA step's shapes (B, H, V) where the step was measured with the merge in one kernel (on an H200, 2026-12-02,
# sixth session, scripts/gpu/ab_call.sh, the 48B step at B = 1 and a 4K cache: 2464.5 us with it against 2470.9
# without in the same call, 370 launch ops against 391); auto takes it only there (any cache length: the merge's
# loop runs over the parts, whatever their count)
UV_MEASURED: set[tuple] = {(1, 32, 128)}


def uv_fits(ql_BHR, qpe_BHP, kv_BSR, length_B, scale, w_kvb_HXR, v0: int, block_v: int = UV_BLOCK,
            only_where_faster: bool = True, **kw) -> str | None:
    """`mla_decode`'s conditions, kv_b_proj's rows [H, X, R] for the heads with W_UV its rows v0: (V = X - v0 in
    blocks of a power of two); `auto` only where the step was measured with it (`UV_MEASURED`: even in time, fewer
    kernels)."""
    why = fits(ql_BHR, qpe_BHP, kv_BSR, length_B, scale, **{k: v for k, v in kw.items() if not k.startswith("merge_")})
    if why:
        return why
    for name in ("merge_pc", "merge_stages"):
        if kw.get(name) is not None and (not isinstance(kw[name], int) or kw[name] < 1 or
                                         (name == "merge_pc" and not pow2(kw[name]))):
            return f"mla_decode_uv kernel: {name} must be a positive int (merge_pc a power of two), got {kw[name]!r}"
    B, H, R = ql_BHR.shape
    if w_kvb_HXR.ndim != 3 or w_kvb_HXR.shape[0] != H or w_kvb_HXR.shape[2] != R or not 0 <= v0 < w_kvb_HXR.shape[1]:
        return (f"mla_decode_uv kernel: kv_b_proj's rows must be [H, X, R] = [{H}, X, {R}] with W_UV from row v0 < X, "
                f"got {w_kvb_HXR.shape}, v0 {v0}")
    V = w_kvb_HXR.shape[1] - v0
    bv = min(block_v, V)
    if not pow2(bv) or V % bv:
        return f"mla_decode_uv kernel: value blocks of {bv} (a power of two) must divide V {V}"
    _, _, split = tiles(B, H, kv_BSR.shape[1], R, qpe_BHP.shape[-1], kw.get("block_h"), kw.get("block_s"),
                        kw.get("split"))
    parts = kv_BSR.shape[1] // split
    rc = merge_columns(parts, R, V, kw.get("merge_r"))
    if not isinstance(rc, int) or rc < 0:
        return f"mla_decode_uv kernel: merge_r must be 0 (off) or a power of two (latent columns a program), got {rc!r}"
    why = _merge_r_problem(parts, V, rc) if rc else None
    if why:
        return why
    if only_where_faster and (B, H, V) not in UV_MEASURED:
        return (f"mla_decode_uv kernel: the step at (B, H, V) = {(B, H, V)} was not measured with it on an "
                "H200 (kernels='on' runs it)")
    return None


# Proven on an H200 (2026-12-02, sixth session): compiled tests (tests/test_kernels.py::test_mla_decode_uv_on_gpu,
# B 1 and 8) and the 48B step (UV_MEASURED).
register(Kernel("mla_decode_uv", uv_reference, mla_decode_uv, platforms=("gpu",), fits=uv_fits,
                measured="B=1, Kimi-Linear-48B TP 1, 4K cache: the step even with it (2464.5 vs 2470.9 us, inside "
                         "the spread), 21 fewer kernels (H200, jax 0.11.2, 2026-12-02)"))
