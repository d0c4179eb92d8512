"""MLA decode between the input projection and the attention kernel as one Pallas kernel (`mla_prep`), beside its
jnp reference `reference` (the MLA layer's own math: jaxk3.layers.mla.mla_step calls it either way).

What it computes, per row b, from the raw projection outputs (fp32, as the GEMVs leave them; in the serving layout one
array y = [c_kv | k_pe | q] read at two offsets, no slice of it copied):

    q            = q_src[b, q_off : q_off + H·(n + P)] in the activation dtype, per head [q_nope (n) | q_pe (P)]
    ql[b, h]     = W_UK[h]ᵀ q_nope_h                      (fp32 sums; W_UK: each head's first n rows of kv_b_proj)
    qpe[b, h]    = q_pe_h
    entry        = [RMSNorm(c_kv; kv_a_layernorm) | k_pe]   in the activation dtype (kv_src at kv_off)
    cache[b, min(length_b, S-1)] = entry                    (rows with valid False keep the old slot)

ql and qpe come out in `out_dtype`: float32 for the jnp attention, or the cache's bf16 when the attention kernel
(jaxk3.kernels.mla_decode) reads them (it rounds them to bf16 anyway: no cast kernel between the two).  XLA runs
this part of the step as five small kernels per MLA layer (the W_UK contraction 3.45 us, the entry's norm and
concatenation 1.34, a reduction 1.09, the cache's update slice 1.01, the query's slice 0.95: the 48B census on an
H200, command buffers off); this kernel takes 5.6 us there, and the 48B step at B = 1 is 21-26 us faster with it
(docs/PERF.md, ninth session).  A first form that reduced each chunk of q_nope's rows as it came (`Config.once`
False) took 7.2 us and made the step 16 us slower.

A source may also be a GEMV's partial sums over its K splits [S, B, X] (jaxk3.kernels.gemv, `sums=True`): the kernel
adds them as it reads its values, so that XLA's kernel adding the 48B in_proj's three splits before this custom call
(1.3 us a layer) goes too.  The MLA layer hands them over with `PARTIALS` on (the default since the tenth session's
census: the MLA layer 1.2-1.6 us faster, 7 launches a step fewer).

The grid is (row, head, block of `Config.br` latent columns): a program reads its head's q_nope and its [n, br] tile of
W_UK in place (kv_b_proj viewed [H, n + v, R]) in chunks of `Config.bk` rows and writes its columns of ql; the
programs (b, h, 0) write the head's q_pe; the program (b, 0, 0) norms the row's c_kv and writes the entry into the
cache, which is aliased in place (no other program of the kernel reads the cache).  The sums run in another order
than XLA's (the contraction over n, the norm's mean), so ql agrees to float32 rounding (then one bf16 rounding when
out_dtype is bf16) and the entry to one rounding of the activation dtype (tests/test_kernels.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels.gemv import add_splits
from jaxk3.kernels.registry import Kernel, pow2, register, triton_params
from jaxk3.kernels.rms_norm import rms_norm

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    br: int = 128  # latent columns of ql per program (a power of two dividing R)
    bk: int = 32  # q_nope rows per step of the contraction (a power of two dividing n)
    num_warps: int = 4
    once: bool = True  # the [bk, br] products accumulated element-wise, reduced over the rows once at the end (False:
    # each chunk reduced as it comes, 1.5 us slower a layer in the 48B census: docs/PERF.md)


def reference(q_src: jax.Array, q_off: int, kv_src: jax.Array, kv_off: int, w_kvb_HXR: jax.Array, n: int,
              norm_w_R: jax.Array, eps: float, kv_BSR: jax.Array, length_B: jax.Array, valid_B: jax.Array, dt,
              out_dtype=F32, config: Config | None = None, **_) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(ql [B, H, R], qpe [B, H, P] in out_dtype, the cache with each valid row's entry written at its slot).
    q_src and kv_src are [B, X], or a GEMV's partial sums over its K splits [S, B, X] (`PARTIALS`): their sum."""
    B, S, L = kv_BSR.shape
    H, _, R = w_kvb_HXR.shape
    P = L - R
    q_src, kv_src = (x if x.ndim == 2 else add_splits(x) for x in (q_src, kv_src))
    q_BHX = q_src[:, q_off:q_off + H * (n + P)].astype(dt).astype(F32).reshape(B, H, n + P)
    ql_BHR = jnp.einsum("bhn,hnr->bhr", q_BHX[..., :n], w_kvb_HXR[:, :n].astype(F32))
    ckv_BL = kv_src[:, kv_off:kv_off + L].astype(dt)
    entry_BL = jnp.concatenate([rms_norm(ckv_BL[:, :R], norm_w_R, eps).astype(dt), ckv_BL[:, R:]], -1)
    rows = jnp.arange(B)
    slot_B = jnp.minimum(length_B, S - 1)
    old_BL = kv_BSR[rows, slot_B]
    kv_BSR = kv_BSR.at[rows, slot_B].set(jnp.where(valid_B[:, None], entry_BL.astype(kv_BSR.dtype), old_BL))
    return ql_BHR.astype(out_dtype), q_BHX[..., n:].astype(out_dtype), kv_BSR


def _kernel(len_ref, valid_ref, q_ref, kvs_ref, w_ref, nw_ref, kv_ref, ql_ref, qpe_ref, kv_out_ref, *, n: int, P: int,
            R: int, S: int, br: int, bk: int, q_off: int, kv_off: int, eps: float, dt, once: bool):
    from jax.experimental import pallas as pl

    del kv_ref  # aliased to kv_out_ref: only the written slot changes
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    def row(ref, start, size):  # ref's row b at [start, start + size): a [S, B, X] source's S partial sums added
        if len(ref.shape) == 2:
            return ref[b, pl.ds(start, size)]
        out = ref[0, b, pl.ds(start, size)]
        for s in range(1, ref.shape[0]):
            out = out + ref[s, b, pl.ds(start, size)]
        return out
    base = q_off + h * (n + P)  # this head's [q_nope | q_pe] in q_src's row
    cols = pl.ds(pl.multiple_of(j * br, br), br)
    acc = jnp.zeros((bk, br) if once else (br,), F32)
    for c in range(n // bk):  # written out: every chunk's loads visible at once
        qn = row(q_ref, base + c * bk, bk).astype(dt).astype(F32)  # [bk]
        prod = w_ref[h, pl.ds(c * bk, bk), cols].astype(F32) * qn[:, None]
        acc = acc + (prod if once else jnp.sum(prod, axis=0))
    ql_ref[b, h, cols] = (jnp.sum(acc, axis=0) if once else acc).astype(ql_ref.dtype)

    @pl.when(j == 0)
    def _():
        qpe_ref[b, h, :] = row(q_ref, base + n, P).astype(dt).astype(qpe_ref.dtype)

    @pl.when((h == 0) & (j == 0) & (valid_ref[b] != 0))
    def _():
        x = row(kvs_ref, kv_off, R).astype(dt).astype(F32)
        normed = nw_ref[...].astype(F32) * x * jax.lax.rsqrt(jnp.mean(x * x) + eps)
        slot = jnp.minimum(len_ref[b], S - 1)
        kv_out_ref[b, slot, pl.ds(0, R)] = normed.astype(dt).astype(kv_out_ref.dtype)
        kv_out_ref[b, slot, pl.ds(R, P)] = row(kvs_ref, kv_off + R, P).astype(dt).astype(kv_out_ref.dtype)


def mla_prep(q_src, q_off: int, kv_src, kv_off: int, w_kvb_HXR, n: int, norm_w_R, eps: float, kv_BSR, length_B,
             valid_B, dt, out_dtype=F32, config: Config | None = None, interpret: bool = False,
             only_where_faster: bool = True):
    """The reference's function as one kernel: (ql [B, H, R], qpe [B, H, P] in out_dtype, the cache, written in place)."""
    from jax.experimental import pallas as pl

    c = config or Config()
    B, S, L = kv_BSR.shape
    H, _, R = w_kvb_HXR.shape
    P = L - R
    br, bk = min(c.br, R), min(c.bk, n)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, n=n, P=P, R=R, S=S, br=br, bk=bk, q_off=q_off, kv_off=kv_off, eps=eps,
                               dt=jnp.dtype(dt), once=c.once)
    return pl.pallas_call(
        kernel, grid=(B, H, R // br), in_specs=[any_] * 7, out_specs=[any_] * 3,
        out_shape=(jax.ShapeDtypeStruct((B, H, R), out_dtype), jax.ShapeDtypeStruct((B, H, P), out_dtype),
                   jax.ShapeDtypeStruct(kv_BSR.shape, kv_BSR.dtype)),
        input_output_aliases={6: 2}, interpret=interpret, name="mla_prep", **triton_params(c.num_warps, 1, interpret),
    )(length_B.astype(jnp.int32), valid_B.astype(jnp.int32), q_src, kv_src, w_kvb_HXR, norm_w_R, kv_BSR)


# Whether the MLA layer hands this kernel in_proj's partial sums over the GEMV's K splits ([3, B, 6720] at the 48B) to add
# as it reads them, instead of their sum, which XLA then adds in a kernel of its own before this one (1.32 us a layer in
# the 48B census, call 3 of the ninth session).  Measured on an H200 (tenth session, docs/PERF.md): the census of layers
# 0-3 with it (twice) put the MLA layer at 39.1 and 38.7 us in 5 kernels against 40.3 in 6, this kernel unchanged (5.56-
# 5.72 us); the step A/Bs (one process each) 2502.9 against 2542.1 us at 4K and 2664.4 against 2832.1 at 32K (a noisy
# main process there: its spread 2620-3242), 7 launch ops fewer, the same greedy tokens.  Where this kernel does not run,
# its reference adds the partials (XLA, as before).  `scripts/gpu/step_with_kernel.py mla_prep:PARTIALS=0 -- ...` times
# the step without.
PARTIALS = True  # (one row only: for B > 1 the GEMV's tensor-core form pads its rows to 16, whose slice is a copy)

# The MLA steps where the 48B step was measured faster with this kernel on an H200; auto takes it only there
# (2026-12-03, ninth session, scripts/gpu/ab_call.sh, Kimi-Linear-48B at B = 1 and a 4K cache: 2469.7 and 2470.5 us a
# step with it against 2491.3-2496.6 without, in two calls; 308 launch ops against 336).  B = 8 and K3's shares: not
# measured.
MEASURED: set[tuple[int, int, int, int]] = {(1, 32, 512, 6720)}  # (B, H, R, the query source's width): the serving
# layout's in_proj output (the checkpoint layout's separate q_proj output, 6144 wide, was not measured)


def fits(q_src, q_off: int, kv_src, kv_off: int, w_kvb_HXR, n: int, norm_w_R, eps, kv_BSR, length_B, valid_B, dt,
         out_dtype=F32, config: Config | None = None, only_where_faster: bool = True, **_) -> str | None:
    """Why this call does not suit the kernel (None: it does)."""
    c = config or Config()
    if kv_BSR.ndim != 3 or w_kvb_HXR.ndim != 3:
        return f"mla_prep kernel takes the cache [B, S, R + P] and kv_b_proj's rows [H, X, R], got {kv_BSR.shape}, " \
               f"{w_kvb_HXR.shape}"
    B, S, L = kv_BSR.shape
    H, X, R = w_kvb_HXR.shape
    P = L - R
    if not 0 < n < X:
        return f"mla_prep kernel: W_UK is each head's first n < X rows of kv_b_proj, got n {n}, X {X}"
    for name, v in (("kv_lora_rank", R), ("qk_rope_head_dim", P), ("qk_nope_head_dim", n), ("Config.br", c.br),
                    ("Config.bk", c.bk)):
        if not pow2(v):
            return f"mla_prep kernel needs {name} a power of two (Triton blocks), got {v}"
    if norm_w_R.shape != (R,):
        return f"mla_prep kernel: kv_a_layernorm must be [{R}], got {norm_w_R.shape}"
    if q_src.ndim not in (2, 3) or q_src.shape[-2] != B or q_src.shape[-1] < q_off + H * (n + P):
        return (f"mla_prep kernel: the query's source must be [(S,) B, >= {q_off + H * (n + P)}] (offset {q_off}, {H} "
                f"heads of {n}+{P}), got {q_src.shape}")
    if kv_src.ndim not in (2, 3) or kv_src.shape[-2] != B or kv_src.shape[-1] < kv_off + L:
        return (f"mla_prep kernel: the latent's source must be [(S,) B, >= {kv_off + L}] (offset {kv_off}), got "
                f"{kv_src.shape}")
    if length_B.shape != (B,) or valid_B.shape != (B,):
        return f"mla_prep kernel: length and valid must be [{B}], got {length_B.shape}, {valid_B.shape}"
    if only_where_faster and (B, H, R, q_src.shape[-1]) not in MEASURED:
        return (f"mla_prep kernel: the step at (B, H, R, query source width) = {(B, H, R, q_src.shape[-1])} was not "
                "measured with it on an H200 (kernels='on' runs it)")
    return None


# Proven on an H200 (2026-12-03, ninth session): compiled tests at the 48B's MLA, B 1 and 8
# (tests/test_kernels.py::test_mla_prep_on_gpu), and the 48B step at B = 1 (MEASURED).
register(Kernel("mla_prep", reference, mla_prep, platforms=("gpu",), fits=fits,
                measured="B=1, Kimi-Linear-48B TP 1, 4K cache: the step 21-26 us faster with it (2469.7-2470.5 vs "
                         "2491.3-2496.6 us), 28 fewer kernels; adding in_proj's partial sums itself (PARTIALS) 2438.0 "
                         "vs 2492.1 us, 7 fewer; elsewhere not measured (H200, jax 0.11.2, 2026-12-03)"))
