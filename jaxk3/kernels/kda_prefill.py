"""KDA's chunked prefill (the gated delta rule over T tokens): the per-chunk scan form `chunk_delta_rule`
(the reference and the CPU path) and a device path whose sequential part is one Pallas (Triton) kernel.

The reference runs one `lax.scan` step per chunk of C tokens: every step builds the chunk's pairwise
decays, its (I + A)⁻¹ and its outputs, about 35 XLA kernels, one chunk after the other (measured on an
H200 inside the Kimi-Linear-48B prefill: 5.9 ms per layer at 4096 tokens, 60% of the prompt's device
time; docs/PERF.md).  But only the state S depends on the previous chunk: everything else of a chunk
(Γ, A, M, W = (I + A)⁻¹ and the decayed q, k) is known from its own tokens.  So the device path
(`chunked`) computes those for every chunk at once (`chunk_operands`: W and M from the `intra_chunk`
kernel, a program per chunk, or from batched XLA products with sub-chunk reference points,
`_decayed_pairs`; the rest elementwise), and one kernel (`state_pass`) walks the chunks in order per
(row, head, block of value columns), with S in registers:

    rhs = β ⊙ v − (β ⊙ e^Γ ⊙ k) S            [C, bv]
    u   = W rhs                              [C, bv]
    o   = (e^Γ ⊙ q) S + M u                  [C, bv]
    S   ← e^{Γ_C} ⊙ S + (e^{Γ_C − Γ} ⊙ k)ᵀ u  [K, bv]

The value columns of S are independent (every product above is column by column in v), so a program
owns bv of them: B·H·V/bv programs.  The kernel's dots run in full float32 (Triton's IEEE input
precision, not TF32): the state is carried over every chunk of the prompt.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxk3.kernels.registry import Kernel, interpret_only, pow2, register, triton_params

F32 = jnp.float32
HI = lax.Precision.HIGHEST


def _unit_lower_inverse(A_BHCC: jax.Array, matmul=None) -> jax.Array:
    """(I + A)⁻¹ for strictly lower-triangular A, by matrix products only: A is nilpotent (A^C = 0),
    so (I + A)⁻¹ = Σ_k (−A)^k = (I − A)(I + A²)(I + A⁴)…, log2(C) squarings.  (No LAPACK custom
    call: XLA's CPU triangular solve starved the 2-device runtime of threads and hung the prefill.)
    `matmul(a, b)`: the product to use (default: a batched einsum; the intra-chunk kernel passes its
    IEEE fp32 dot on [C, C] tiles)."""
    C = A_BHCC.shape[-1]
    matmul = matmul or (lambda a, b: jnp.einsum("...ij,...jk->...ik", a, b))
    eye = jnp.eye(C, dtype=A_BHCC.dtype)
    P = -A_BHCC
    inv = eye + P
    for _ in range(max(0, (C - 1).bit_length() - 1)):
        P = matmul(P, P)
        inv = matmul(inv, eye + P)
    return inv


def chunk_delta_rule(q_BHTK: jax.Array, k_BHTK: jax.Array, v_BHTV: jax.Array, g_BHTK: jax.Array,
                     beta_BHT: jax.Array, state_BHKV: jax.Array, chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over T tokens in chunks (the WY / UT-transform form), fp32.

    Equal to T recurrent steps `S ← diag(e^g) S; u = β(v − Sᵀk); S ← S + k uᵀ; o = Sᵀq` (q already
    scaled).  Within a chunk, with Γ_t = Σ_{s≤t} g_s (per key channel) and S_0 the incoming state:

        A[t,s] = β_t Σ_c k_t[c] k_s[c] e^{Γ_t[c]−Γ_s[c]}     s < t   (strictly lower)
        (I + A) u = β ⊙ (v − (e^Γ ⊙ k) S_0)                      (unit lower-triangular: _unit_lower_inverse)
        o_t    = (e^{Γ_t} ⊙ q_t) S_0 + Σ_{s≤t} (Σ_c q_t[c] k_s[c] e^{Γ_t[c]−Γ_s[c]}) u_s
        S_C    = diag(e^{Γ_C}) S_0 + Σ_s diag(e^{Γ_C−Γ_s}) k_s u_sᵀ

    Γ_t − Γ_s ≤ 0 for s ≤ t (g ≤ 0), so every exponential is ≤ 1.  T must be a multiple of `chunk`.
    Returns (o_BHTV, final state_BHKV).
    """
    B, H, T, K = q_BHTK.shape
    C = min(chunk, T)
    if T % C:
        raise ValueError(f"chunk_delta_rule: T={T} is not a multiple of the chunk {C}")
    n = T // C

    def split(a):  # [B, H, T, ...] -> [n, B, H, C, ...]
        return jnp.moveaxis(a.reshape(B, H, n, C, *a.shape[3:]), 2, 0)

    causal = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)

    def one_chunk(S, xs):
        q, k, v, g, beta = xs  # [B,H,C,K], [B,H,C,K], [B,H,C,V], [B,H,C,K], [B,H,C]
        G = jnp.cumsum(g, axis=2)
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [B,H,t,s,K] = Γ_t − Γ_s
        decay = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))
        A = jnp.einsum("bhtc,bhsc,bhtsc->bhts", k, k, decay) * beta[..., None]
        A = jnp.where(strict, A, 0.0)
        rhs = beta[..., None] * (v - jnp.einsum("bhtk,bhkv->bhtv", jnp.exp(G) * k, S))
        u = jnp.einsum("bhts,bhsv->bhtv", _unit_lower_inverse(A), rhs)
        M = jnp.einsum("bhtc,bhsc,bhtsc->bhts", q, k, decay)
        o = jnp.einsum("bhtk,bhkv->bhtv", jnp.exp(G) * q, S) + jnp.einsum("bhts,bhsv->bhtv", M, u)
        last = G[:, :, -1:, :]  # Γ_C
        S = jnp.exp(last[:, :, 0, :])[..., None] * S + jnp.einsum("bhsk,bhsv->bhkv", jnp.exp(last - G) * k, u)
        return S, o

    S, o = jax.lax.scan(one_chunk, state_BHKV.astype(F32),
                        tuple(split(a.astype(F32)) for a in (q_BHTK, k_BHTK, v_BHTV, g_BHTK, beta_BHT)))
    return jnp.moveaxis(o, 0, 2).reshape(B, H, T, -1), S


def _decayed_pairs(L_nCK: jax.Array, R_nCK: jax.Array, G_nCK: jax.Array, sub: int, strict: bool) -> jax.Array:
    """P[t, s] = Σ_c L_t[c] R_s[c] e^{Γ_t[c] − Γ_s[c]} for s ≤ t (s < t if `strict`), else 0, per chunk:
    [..., C, K] operands -> [..., C, C], fp32.  Γ is non-increasing along the chunk (g ≤ 0), so every
    true factor is ≤ 1, but e^{Γ_t} e^{−Γ_s} taken apart can overflow; so the chunk goes in sub-chunks
    of `sub` tokens.  A block of sub-chunk i against an earlier one factors through Γ_r, Γ at the last
    token before sub-chunk i: e^{Γ_t − Γ_s} = e^{Γ_t − Γ_r} e^{Γ_r − Γ_s}, both factors ≤ 1 (t > r ≥ s),
    so those blocks are plain matrix products; the diagonal blocks take the pairwise form (exact, sub²·K
    exponentials per sub-chunk)."""
    *lead, C, K = L_nCK.shape
    m = C // sub
    Ls, Gs, Rs = (a.reshape(*lead, m, sub, K) for a in (L_nCK, G_nCK, R_nCK))
    tri = jnp.tril(jnp.ones((sub, sub), bool), -1 if strict else 0)
    diff = Gs[..., :, None, :] - Gs[..., None, :, :]
    decay = jnp.exp(jnp.where(tri[:, :, None], diff, -jnp.inf))
    diag = jnp.einsum("...tc,...sc,...tsc->...ts", Ls, Rs, decay)  # [..., m, t, s]
    if m == 1:
        return diag.reshape(*lead, C, C)
    G_ref = jnp.concatenate([jnp.zeros_like(Gs[..., :1, 0, :]), Gs[..., :-1, -1, :]], -2)  # [..., m, K]
    Lq = Ls * jnp.exp(Gs - G_ref[..., :, None, :])  # [..., m(i), sub(t), K]
    before = jnp.arange(C)[None, :] < (jnp.arange(m) * sub)[:, None]  # [m(i), C(s)]: s before sub-chunk i
    expo = jnp.where(before[:, :, None], G_ref[..., :, None, :] - G_nCK[..., None, :, :], -jnp.inf)
    Rk = R_nCK[..., None, :, :] * jnp.exp(expo)  # [..., m(i), C(s), K]
    off = jnp.einsum("...itc,...isc->...its", Lq, Rk).reshape(*lead, C, C)
    eye = jnp.eye(m, dtype=bool)[:, None, :, None]
    blocks = jnp.where(eye, diag[..., :, :, None, :], 0.0)  # [..., m(i), t, m(j), s]
    return off + blocks.reshape(*lead, C, C)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChunkOperands:
    """What the state pass needs of each chunk, for all chunks at once, rows [B·H, T, ·] (chunk j is rows
    j·C .. j·C + C − 1), fp32."""
    W: jax.Array  # [BH, T, C]   (I + A)⁻¹ of the row's chunk
    M: jax.Array  # [BH, T, C]   Σ_c q_t k_s e^{Γ_t − Γ_s}, s ≤ t
    kg: jax.Array  # [BH, T, K]  β ⊙ e^Γ ⊙ k
    qg: jax.Array  # [BH, T, K]  e^Γ ⊙ q
    kd: jax.Array  # [BH, T, K]  e^{Γ_C − Γ} ⊙ k
    bv: jax.Array  # [BH, T, V]  β ⊙ v
    gC: jax.Array  # [BH, n, K]  e^{Γ_C} per chunk


def chunk_operands(q_BHTK, k_BHTK, v_BHTV, g_BHTK, beta_BHT, chunk: int, sub: int = 16, intra: str = "xla",
                   interpret: bool = False) -> ChunkOperands:
    """Every chunk's own part of the chunked delta rule (see the module docstring), batched over chunks.
    W and M come from batched XLA products (`intra="xla"`: `_decayed_pairs`, `_unit_lower_inverse`) or from
    the `intra_chunk` kernel (`intra="kernel"`: the exact pairwise form, one program per chunk)."""
    B, H, T, K = q_BHTK.shape
    C = min(chunk, T)
    n = T // C
    c = sub if C % sub == 0 else C
    q, k, v, g = (a.astype(F32).reshape(B, H, n, C, -1) for a in (q_BHTK, k_BHTK, v_BHTV, g_BHTK))
    beta = beta_BHT.astype(F32).reshape(B, H, n, C, 1)
    G = jnp.cumsum(g, axis=3)
    eG = jnp.exp(G)
    G_C = G[:, :, :, -1:, :]

    def rows(a):
        return a.reshape(B * H, T, a.shape[-1])

    if intra == "kernel":
        W, M = intra_chunk(rows(q), rows(k), rows(G), beta.reshape(B * H, T), C, interpret)
    else:
        A = beta * _decayed_pairs(k, k, G, c, strict=True)
        W, M = rows(_unit_lower_inverse(A)), rows(_decayed_pairs(q, k, G, c, strict=False))
    return ChunkOperands(W=W, M=M, kg=rows(beta * eG * k), qg=rows(eG * q),
                         kd=rows(jnp.exp(G_C - G) * k), bv=rows(beta * v),
                         gC=jnp.exp(G_C[:, :, :, 0, :]).reshape(B * H, n, K))


def _intra_kernel(q_ref, k_ref, kT_ref, G_ref, GT_ref, beta_ref, W_ref, M_ref, *, C: int, K: int):
    from jax.experimental import pallas as pl

    bh, j = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(pl.multiple_of(j * C, C), C)
    t = jnp.arange(C)[:, None]
    s = jnp.arange(C)[None, :]

    def body(ch, AM):  # key channel ch: its rank-one part of A and M, exact decays e^{Γ_t − Γ_s} (s <= t)
        A, M = AM
        col = pl.ds(ch, 1)
        Gt, Gs = G_ref[bh, rows, col], GT_ref[bh, col, rows]  # [C, 1], [1, C]
        decay = jnp.exp(jnp.where(s <= t, Gt - Gs, -jnp.inf))  # [C, C], <= 1
        ks = kT_ref[bh, col, rows] * decay  # k_s e^{Γ_t − Γ_s}
        return A + k_ref[bh, rows, col] * ks, M + q_ref[bh, rows, col] * ks

    zero = jnp.zeros((C, C), F32)
    A, M = lax.fori_loop(0, K, body, (zero, zero))
    A = jnp.where(s < t, A, 0.0) * beta_ref[bh, rows][:, None]  # strictly lower, row t scaled by β_t
    W_ref[bh, rows, :] = _unit_lower_inverse(A, _dot)
    M_ref[bh, rows, :] = M


def intra_chunk(q_NTK, k_NTK, G_NTK, beta_NT, C: int, interpret: bool = False,
                num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
    """(W, M) [N, T, C] of every chunk as one Pallas kernel, a program per (row·head, chunk): A and M in
    the exact pairwise form (one channel at a time: [C, C] exponentials of Γ_t − Γ_s ≤ 0, never of a
    positive sum), then (I + A)⁻¹ by log2(C) squarings; IEEE fp32 dots.  Γ = the within-chunk cumsum."""
    from jax.experimental import pallas as pl

    N, T, K = q_NTK.shape
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    kw = triton_params(num_warps, 1, interpret)
    return pl.pallas_call(
        functools.partial(_intra_kernel, C=C, K=K), grid=(N, T // C), in_specs=[any_] * 6, out_specs=[any_] * 2,
        out_shape=(jax.ShapeDtypeStruct((N, T, C), F32),) * 2, interpret=interpret, **kw,
    )(q_NTK, k_NTK, jnp.swapaxes(k_NTK, 1, 2), G_NTK, jnp.swapaxes(G_NTK, 1, 2), beta_NT)


def state_pass_reference(ops: ChunkOperands, state_BHKV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The kernel's function in jnp (its test oracle): (o [BH, T, V], final S [BH, K, V]), fp32."""
    BH, T, C = ops.W.shape
    n = T // C

    def chunks(a):  # [BH, T, X] -> [n, BH, C, X]
        return jnp.moveaxis(a.reshape(BH, n, C, -1), 1, 0)

    def step(S, xs):
        W, M, kg, qg, kd, bv, gC = xs
        u = jnp.einsum("bts,bsv->btv", W, bv - jnp.einsum("btk,bkv->btv", kg, S, precision=HI), precision=HI)
        o = jnp.einsum("btk,bkv->btv", qg, S, precision=HI) + jnp.einsum("bts,bsv->btv", M, u, precision=HI)
        return gC[..., None] * S + jnp.einsum("bsk,bsv->bkv", kd, u, precision=HI), o

    S, o = lax.scan(step, state_BHKV.reshape(BH, *state_BHKV.shape[2:]).astype(F32),
                    tuple(chunks(a) for a in (ops.W, ops.M, ops.kg, ops.qg, ops.kd, ops.bv))
                    + (jnp.moveaxis(ops.gC, 1, 0),))
    return jnp.moveaxis(o, 0, 1).reshape(BH, T, -1), S


def _dot(a, b, ca: int = 1, cb: int = 0):
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=HI, preferred_element_type=F32)


def _state_kernel(W_ref, M_ref, kg_ref, qg_ref, kd_ref, bv_ref, gC_ref, S0_ref, o_ref, S_ref, *, C: int, n: int,
                  bv: int):
    from jax.experimental import pallas as pl

    bh, vb = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(vb * bv, bv), bv)

    def body(j, S):
        rows = pl.ds(pl.multiple_of(j * C, C), C)
        rhs = bv_ref[bh, rows, cols] - _dot(kg_ref[bh, rows, :], S)  # [C, bv]
        u = _dot(W_ref[bh, rows, :], rhs)
        o_ref[bh, rows, cols] = _dot(qg_ref[bh, rows, :], S) + _dot(M_ref[bh, rows, :], u)
        return gC_ref[bh, j, :][:, None] * S + _dot(kd_ref[bh, rows, :], u, 0, 0)  # kdᵀ u: [K, bv]

    S_ref[bh, :, cols] = lax.fori_loop(0, n, body, S0_ref[bh, :, cols])


@dataclasses.dataclass(frozen=True)
class Config:
    block_v: int = 32  # value columns per program of the state pass
    num_warps: int = 4
    num_stages: int = 2
    intra: str = "kernel"  # W and M: "kernel" (intra_chunk) or "xla" (batched products, chunk_operands)


def state_pass(ops: ChunkOperands, state_BHKV: jax.Array, config: Config | None = None,
               interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`state_pass_reference` as one Pallas kernel: grid (B·H, V / block_v), the chunks in order inside."""
    from jax.experimental import pallas as pl

    c = config or Config()
    BH, T, C = ops.W.shape
    K, V = ops.kg.shape[-1], ops.bv.shape[-1]
    S0 = state_BHKV.reshape(BH, K, V).astype(F32)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    kw = triton_params(c.num_warps, c.num_stages, interpret)
    return pl.pallas_call(
        functools.partial(_state_kernel, C=C, n=T // C, bv=c.block_v), grid=(BH, V // c.block_v),
        in_specs=[any_] * 8, out_specs=[any_] * 2,
        out_shape=(jax.ShapeDtypeStruct((BH, T, V), F32), jax.ShapeDtypeStruct((BH, K, V), F32)),
        interpret=interpret, **kw)(ops.W, ops.M, ops.kg, ops.qg, ops.kd, ops.bv, ops.gC, S0)


def chunked(q_BHTK, k_BHTK, v_BHTV, g_BHTK, beta_BHT, state_BHKV, chunk: int = 64, config: Config | None = None,
            interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`chunk_delta_rule`'s function: every chunk's operands at once, then the state pass kernel."""
    B, H, T, _ = q_BHTK.shape
    c = config or Config()
    ops = chunk_operands(q_BHTK, k_BHTK, v_BHTV, g_BHTK, beta_BHT, chunk, intra=c.intra, interpret=interpret)
    o, S = state_pass(ops, state_BHKV, c, interpret)
    return o.reshape(B, H, T, -1), S.reshape(state_BHKV.shape)


def fits(q_BHTK, k_BHTK, v_BHTV, g_BHTK, beta_BHT, state_BHKV, chunk: int = 64, config: Config | None = None,
         **_) -> str | None:
    c = config or Config()
    T, K, V = q_BHTK.shape[2], q_BHTK.shape[-1], v_BHTV.shape[-1]
    C = min(chunk, T)
    for name, v in (("the chunk", C), ("the key head dim", K), ("the value head dim", V), ("block_v", c.block_v)):
        if not pow2(v) or v < 16:
            return f"kda_prefill kernel needs {name} a power of two >= 16 (Triton blocks, tl.dot), got {v}"
    if T % C:
        return f"kda_prefill kernel needs T = {T} a multiple of the chunk {C}"
    if V % c.block_v:
        return f"kda_prefill kernel: block_v {c.block_v} must divide the value head dim {V}"
    if c.intra not in ("kernel", "xla"):
        return f"kda_prefill kernel: intra must be 'kernel' or 'xla', got {c.intra!r}"
    return None


register(Kernel("kda_prefill", chunk_delta_rule, chunked, platforms=("gpu",), fits=fits,
                unproven=interpret_only("test_kda_prefill_kernel_on_gpu")))
