"""KDA's chunked prefill (the gated delta rule over T tokens): the per-chunk scan form `chunk_delta_rule`
(the reference and the CPU path) and a device path whose sequential part is one Pallas (Triton) kernel.

The reference runs one `lax.scan` step per chunk of C tokens: every step builds the chunk's pairwise
decays, its (I + A)⁻¹ and its outputs, about 35 XLA kernels, one chunk after the other (measured on an
H200 inside the Kimi-Linear-48B prefill: 5.9 ms per layer at 4096 tokens, 60% of the prompt's device
time; docs/PERF.md).  But only the state S depends on the previous chunk: everything else of a chunk
(Γ, A, M, W = (I + A)⁻¹ and the decayed q, k) is known from its own tokens.  So the device path
(`chunked`) computes those for every chunk at once in XLA (`chunk_operands`: W and M from batched
products with sub-chunk reference points, `_decayed_pairs`; the rest elementwise), and one kernel
(`state_pass`) walks the chunks in order per (row, head, block of value columns), with S in registers:

    rhs = β ⊙ v − (β ⊙ e^Γ ⊙ k) S            [C, bv]
    u   = W rhs                              [C, bv]
    o   = (e^Γ ⊙ q) S + M u                  [C, bv]
    S   ← e^{Γ_C} ⊙ S + (e^{Γ_C − Γ} ⊙ k)ᵀ u  [K, bv]

The value columns of S are independent (every product above is column by column in v), so a program
owns bv of them: B·H·V/bv programs.  The kernel's dots keep float32's precision (TF32x3 by default, see
PRECISIONS; not one TF32 product): the state is carried over every chunk of the prompt.

Measured on an H200 at Kimi-Linear-48B's 32 heads of 128 x 128 (docs/PERF.md, 2026-12-02): 4096 tokens
2.35 ms against the scan form's 4.99 (2.13x), 8 rows x 1024 tokens 4.63 against 6.15 (1.33x).  A Pallas
kernel for W and M too (a program per chunk, the pairwise decays one key channel at a time) was built and
measured 20x slower than these XLA products (22.4 vs 1.12 ms), so it was removed.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxk3.kernels.registry import Kernel, pow2, register, triton_params

F32 = jnp.float32
HI = lax.Precision.HIGHEST


def _unit_lower_inverse(A_BHCC: jax.Array) -> jax.Array:
    """(I + A)⁻¹ for strictly lower-triangular A, by matrix products only: A is nilpotent (A^C = 0),
    so (I + A)⁻¹ = Σ_k (−A)^k = (I − A)(I + A²)(I + A⁴)…, log2(C) squarings.  (No LAPACK custom
    call: XLA's CPU triangular solve starved the 2-device runtime of threads and hung the prefill.)"""
    C = A_BHCC.shape[-1]
    eye = jnp.eye(C, dtype=A_BHCC.dtype)
    P = -A_BHCC
    inv = eye + P
    for _ in range(max(0, (C - 1).bit_length() - 1)):
        P = jnp.einsum("...ij,...jk->...ik", P, P)
        inv = jnp.einsum("...ij,...jk->...ik", inv, eye + P)
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


def chunk_operands(q_BHTK, k_BHTK, v_BHTV, g_BHTK, beta_BHT, chunk: int, sub: int = 16) -> ChunkOperands:
    """Every chunk's own part of the chunked delta rule (see the module docstring), batched over chunks:
    W and M from batched XLA products (`_decayed_pairs`, `_unit_lower_inverse`), the rest elementwise."""
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

    A = beta * _decayed_pairs(k, k, G, c, strict=True)
    return ChunkOperands(W=rows(_unit_lower_inverse(A)), M=rows(_decayed_pairs(q, k, G, c, strict=False)),
                         kg=rows(beta * eG * k), qg=rows(eG * q), kd=rows(jnp.exp(G_C - G) * k), bv=rows(beta * v),
                         gC=jnp.exp(G_C[:, :, :, 0, :]).reshape(B * H, n, K))


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


def _dot(a, b, ca: int = 1, cb: int = 0, precision=HI):
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=precision, preferred_element_type=F32)


# The state pass's dot inputs (Config.precision): "ieee" full float32 on the CUDA cores (Triton's IEEE input
# precision); "tf32x3" three TF32 tensor-core products whose sum carries float32's 24-bit significand to
# within a few ulp (a split of each input into a TF32 head and tail, the tail-tail product dropped);
# "tf32" one TF32 product (10-bit significand: a relative error of ~1e-3 per product, carried over chunks).
# Measured on an H200 (docs/PERF.md, 4096 tokens, 32 heads of 128 x 128, block_v 32, 4 warps): the state
# pass alone takes tf32x3 0.939 ms, ieee (8 warps, its best) 5.55 ms, tf32 0.457 ms; tf32x3 is the default,
# its output within 3.8e-7 of the output's max from ieee's (tf32: 5.5e-4).
PRECISIONS = {"ieee": HI, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
              "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32}


def _state_kernel(W_ref, M_ref, kg_ref, qg_ref, kd_ref, bv_ref, gC_ref, S0_ref, o_ref, S_ref, *, C: int, n: int,
                  bv: int, precision):
    from jax.experimental import pallas as pl

    dot = functools.partial(_dot, precision=precision)

    bh, vb = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(vb * bv, bv), bv)

    def body(j, S):
        rows = pl.ds(pl.multiple_of(j * C, C), C)
        rhs = bv_ref[bh, rows, cols] - dot(kg_ref[bh, rows, :], S)  # [C, bv]
        u = dot(W_ref[bh, rows, :], rhs)
        o_ref[bh, rows, cols] = dot(qg_ref[bh, rows, :], S) + dot(M_ref[bh, rows, :], u)
        return gC_ref[bh, j, :][:, None] * S + dot(kd_ref[bh, rows, :], u, 0, 0)  # kdᵀ u: [K, bv]

    S_ref[bh, :, cols] = lax.fori_loop(0, n, body, S0_ref[bh, :, cols])


@dataclasses.dataclass(frozen=True)
class Config:
    block_v: int = 32  # value columns per program of the state pass
    num_warps: int = 4
    num_stages: int = 2
    precision: str = "tf32x3"  # the state pass's dots: a key of PRECISIONS (interpret mode always runs "ieee")


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
        functools.partial(_state_kernel, C=C, n=T // C, bv=c.block_v,
                          precision=HI if interpret else PRECISIONS[c.precision]), grid=(BH, V // c.block_v),
        in_specs=[any_] * 8, out_specs=[any_] * 2,
        out_shape=(jax.ShapeDtypeStruct((BH, T, V), F32), jax.ShapeDtypeStruct((BH, K, V), F32)),
        interpret=interpret, name="kda_prefill_state", **kw)(ops.W, ops.M, ops.kg, ops.qg, ops.kd, ops.bv, ops.gC, S0)


def chunked(q_BHTK, k_BHTK, v_BHTV, g_BHTK, beta_BHT, state_BHKV, chunk: int = 64, config: Config | None = None,
            interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`chunk_delta_rule`'s function: every chunk's operands at once, then the state pass kernel."""
    B, H, T, _ = q_BHTK.shape
    c = config or Config()
    ops = chunk_operands(q_BHTK, k_BHTK, v_BHTV, g_BHTK, beta_BHT, chunk)
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
    if c.precision == "tf32x3" and c.block_v * K > 32 * 128:  # the TF32x3 split's tiles in shared memory
        return (f"kda_prefill kernel: block_v {c.block_v} x the key head dim {K} does not fit shared memory with "
                "TF32x3 dots (measured on an H200: 64 x 128 asked 262144 B, 232448 available; at most 4096; "
                "64 x 128 compiled with ieee and tf32)")
    if c.precision not in PRECISIONS:
        return f"kda_prefill kernel: precision must be one of {sorted(PRECISIONS)}, got {c.precision!r}"
    return None


register(Kernel("kda_prefill", chunk_delta_rule, chunked, platforms=("gpu",), fits=fits,
                measured="Kimi-Linear-48B dims: 2.13x the scan form at a 4096-token prompt (2.35 vs 4.99 ms), 1.33x "
                         "at 8 x 1024 tokens (4.63 vs 6.15 ms) (H200, jax 0.11.2, 2026-12-02)"))
