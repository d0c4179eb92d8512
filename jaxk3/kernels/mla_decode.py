"""Absorbed MLA decode attention over the latent cache, split over the context (flash-decoding),
as a Pallas kernel beside its jnp reference `latent_attention`.

The reference scores every cache slot of every head at once ([B, H, S] scores, a softmax, a second
pass over the cache); at long contexts XLA runs that as a few kernels with little parallelism over S.
Here the cache's S slots are cut into `splits` parts, and a grid program per (row, head group,
part) walks its part in blocks of BLOCK_S slots with an online softmax (running max m, sum l,
weighted sum acc of c_kv), reading each cache entry once for its head group; slots past the row's
length are skipped.  A short jnp step merges the parts (log-sum-exp).  float32 throughout, as in
the reference; the sums run in another order, so results agree to float32 rounding.

Tiles (`tiles`, FlashMLA-style): a head group of 16 and 32 slots per step keep the staged operands
in shared memory (`smem_estimate`, which reproduces the 442,624 B the first tiling of 64 x 64 asked
for on an H200, where a block has 232,448 B); `fits` names a tiling that cannot fit instead of
failing at compile time.  The context split shrinks until there are >= 2 programs per SM, while the
partial sums it writes stay under about half the cache bytes.

Measured on an H200 (2026-12-01, docs/PERF.md): compiles and matches the reference at every preset
shape (K3 TP 1/2/8, Kimi-Linear-48B; 1.1e-6 against fp32 dots), but the float32 dots lower to
CUDA-core FMAs: 3.3 ms against XLA's 33 us at K3 TP 1, B = 1, 4K context.  Hence `unproven`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels.registry import Kernel, interpret_only, register

F32 = jnp.float32
BLOCK_S = 32  # cache slots per inner step (default; `tiles`)
SPLIT = 1024  # at most this many cache slots per grid program (parts = ceil(S / split))
BLOCK_H = 16  # heads per grid program (padded to a power of two >= 16 for the dots)
NEG = -1e30  # a finite "minus infinity": exp(NEG - m) is 0 without inf - inf
SMEM_BYTES = 232_448  # shared memory a block may use on an H100/H200 (sm_90)
MIN_PROGRAMS = 264  # aim for >= 2 programs per SM (132 SMs): the context split shrinks until there are


def smem_estimate(Hb: int, bs: int, R: int, P: int) -> int:
    """Shared memory the Triton lowering asks for, as measured: 4 bytes x (q_latent [Hb, R] + the cache
    tile [bs, R] staged twice (once per dot) + q_pe [Hb, P] + k_pe [bs, P] + p [Hb, bs]) + 256.  It
    reproduces the 442,624 B that Hb = 64, bs = 64, R = 512, P = 64 asked for on an H200."""
    return 4 * (Hb * R + 2 * bs * R + Hb * P + bs * P + Hb * bs) + 256


def tiles(B: int, H: int, S: int, R: int, P: int, block_h: int | None = None, block_s: int | None = None,
          split: int | None = None) -> tuple[int, int, int]:
    """(Hb, bs, split): the head group, the slots per inner step, the slots per grid program."""
    Hb = block_h or min(BLOCK_H, max(16, 1 << (H - 1).bit_length()))
    bs = block_s or BLOCK_S
    if split is None:
        G = -(-H // Hb)
        split = min(SPLIT, S)
        # shrink the split for parallelism while the partial sums written ([G·Hb, R] fp32 per part) stay
        # under ~half the cache bytes read (split >= 4 x the padded heads)
        while (split > 2 * bs and split % 2 == 0 and S % (split // 2) == 0 and B * G * (S // split) < MIN_PROGRAMS
               and split // 2 >= 4 * G * Hb):
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


_HI = jax.lax.Precision.HIGHEST  # float32 dots (not TF32), as the reference


def _dot_t(a, b):
    """a [M, K] @ b[N, K].T -> [M, N] in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=F32)


def _kernel(len_ref, ql_ref, qpe_ref, kv_ref, m_ref, l_ref, acc_ref, *, R: int, P: int, S: int, split: int,
            scale: float, BLOCK_S: int):
    from jax.experimental import pallas as pl

    b, hg, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = len_ref[b]
    ql, qpe = ql_ref[b, hg], qpe_ref[b, hg]  # [Hb, R], [Hb, P]
    Hb = ql.shape[0]
    start = part * split
    steps = jnp.clip((jnp.minimum(length + 1, S) - start + BLOCK_S - 1) // BLOCK_S, 0, split // BLOCK_S)

    def body(i, carry):
        m, l, acc = carry
        pos = start + i * BLOCK_S
        c = kv_ref[b, pl.ds(pos, BLOCK_S), pl.ds(0, R)].astype(F32)  # [BS, R]
        kpe = kv_ref[b, pl.ds(pos, BLOCK_S), pl.ds(R, P)].astype(F32)  # [BS, P]
        s = (_dot_t(ql, c) + _dot_t(qpe, kpe)) * scale  # [Hb, BS]
        ok = (pos + jnp.arange(BLOCK_S))[None, :] <= length
        s = jnp.where(ok, s, NEG)
        c = jnp.where(ok.reshape(BLOCK_S, 1), c, 0.0)  # slots past the length: never part of the sum
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + jnp.dot(p, c, precision=_HI)

    init = (jnp.full((Hb,), NEG, F32), jnp.zeros((Hb,), F32), jnp.zeros((Hb, R), F32))
    m, l, acc = jax.lax.fori_loop(0, steps, body, init)
    m_ref[b, hg, part] = m
    l_ref[b, hg, part] = l
    acc_ref[b, hg, part] = acc


def mla_decode(ql_BHR, qpe_BHP, kv_BSR, length_B, scale: float, interpret: bool = False, block_h: int | None = None,
               block_s: int | None = None, split: int | None = None, num_warps: int = 4,
               num_stages: int = 2) -> jax.Array:
    """The same function as the reference: fp32 [B, H, R]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    B, H, R = ql_BHR.shape
    S, P = kv_BSR.shape[1], qpe_BHP.shape[-1]
    Hb, bs, split = tiles(B, H, S, R, P, block_h, block_s, split)
    G = -(-H // Hb)
    parts = S // split
    kw = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))

    def heads(x):  # [B, H, X] -> [B, G, Hb, X], padded heads score 0 and are dropped below
        x = jnp.pad(x.astype(F32), ((0, 0), (0, G * Hb - H), (0, 0)))
        return x.reshape(B, G, Hb, x.shape[-1])

    any_ = pl.BlockSpec(memory_space=pl.ANY)
    m, l, acc = pl.pallas_call(
        functools.partial(_kernel, R=R, P=P, S=S, split=split, scale=scale, BLOCK_S=bs), grid=(B, G, parts),
        in_specs=[any_] * 4, out_specs=[any_] * 3, **kw,
        out_shape=(jax.ShapeDtypeStruct((B, G, parts, Hb), F32), jax.ShapeDtypeStruct((B, G, parts, Hb), F32),
                   jax.ShapeDtypeStruct((B, G, parts, Hb, R), F32)),
        interpret=interpret,
    )(length_B.astype(jnp.int32), heads(ql_BHR), heads(qpe_BHP), kv_BSR)
    w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))  # parts past the length: m = NEG, weight 0
    out = jnp.sum(w[..., None] * acc, axis=2) / jnp.sum(w * l, axis=2)[..., None]
    return out.reshape(B, G * Hb, R)[:, :H]


reference = latent_attention


def fits(ql_BHR, qpe_BHP, kv_BSR, length_B, scale, block_h: int | None = None, block_s: int | None = None,
         split: int | None = None, **_) -> str | None:
    B, H, R = ql_BHR.shape
    P, S = qpe_BHP.shape[-1], kv_BSR.shape[1]
    for name, n in (("kv_lora_rank", R), ("qk_rope_head_dim", P)):
        if n & (n - 1) or n < 16:
            return f"mla_decode kernel needs {name} a power of two >= 16 (Triton blocks), got {n}"
    Hb, bs, split = tiles(B, H, S, R, P, block_h, block_s, split)
    if S % bs or S % split or split % bs:
        return (f"mla_decode kernel needs the cache length {S} a multiple of the split {split}, itself a multiple "
                f"of the {bs}-slot block")
    need = smem_estimate(Hb, bs, R, P)
    if need > SMEM_BYTES:
        return (f"mla_decode kernel: {Hb} heads x {bs} slots of a {R}+{P} latent need ~{need:,} B of shared "
                f"memory, more than the {SMEM_BYTES:,} B a block has (smaller block_h / block_s)")
    return None


register(Kernel("mla_decode", reference, mla_decode, platforms=("gpu",), fits=fits,
                unproven="100x slower than XLA at real dims on an H200 (3.3 ms vs 33 us, K3 TP 1, B 1, 4K: fp32 "
                         "dots on CUDA cores), though its compiled real-dims tests pass (tests/test_kernels_real.py; "
                         "test_mla_decode_kernel_on_gpu in tests/test_kernels.py compares against TF32 dots)"))
