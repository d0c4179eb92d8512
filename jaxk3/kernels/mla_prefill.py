"""Absorbed MLA prefill attention (causal, over the latent cache) as a flash-attention Pallas kernel
beside its jnp reference `latent_attention_prefill`.

The reference scores every (token, head) against every cache slot at once: an fp32 [B, T, H, S]
score tensor (2.3 GB for a 4096-token chunk of Kimi-Linear-48B's 32 heads), a softmax over it and a
second pass; the prefill profile (docs/PERF.md) put Kimi-Linear-48B's MLA at 20% of a 4K prompt's
device time.  All heads share one latent "key/value" per slot (absorbed MLA is multi-query attention
with a kv_lora_rank + rope wide key and a kv_lora_rank wide value), so the kernel packs (token, head)
pairs into the rows of a tile: a grid program owns `bm` consecutive rows of [T·H] (row r is token
r // H, head r % H) and walks the cache in blocks of `bn` slots with an online softmax (running max m,
sum l, weighted sum acc of c_kv), reading each slot block once for all its rows' heads.  A row sees
the slots up to its token's `limit` (its own slot: causal over the cached prefix and the chunk), and a
program walks only the blocks below the largest limit of its rows, so the causal upper triangle is
skipped; slots past that are masked out of the loads (never read: an unwritten slot may hold
anything) and every slot past a row's own limit out of its softmax.

Precision as in `mla_decode`: the dots run on the tensor cores with bf16 operands (the bf16 cache as
stored; q_latent, q_pe and the probabilities p rounded to bf16) and float32 accumulation; the softmax
statistics and the rescaling stay float32.  tests/test_kernels.py works out the tolerance.

Tiles (`Config`): bm rows (the dots' M) x bn slots; the fp32 accumulator [bm, R] lives in registers
(bm·R / (32·num_warps) per thread, at most ACC_REGS), the q tile [bm, R + P] and the slot tile in
shared memory (`smem_estimate`, the formula `mla_decode` measured; `fits` names a tiling over).

The per-head form (`heads_prefill`, Config(form="heads")) expands each slot's per-head key W_UK[h] c_s and value
W_UV[h] c_s first and runs a causal flash kernel per (row, head, token tile) on (N + P) and V wide dots: 320 columns
a slot at Kimi-Linear-48B against the absorbed form's 1088.  The expansion covers every cache slot, so `choose`
(what `attention_device` runs without a config) takes that form only where the chunk is a large part of the cache
(HEADS_MAX_RATIO, HEADS_MAX_BYTES); on an H200 it ran 2.1-2.8x faster than the absorbed kernel there.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxk3.kernels.mla_decode import NEG, tile_limits
from jaxk3.kernels.registry import Kernel, dot_nt, pow2, register, triton_params

F32 = jnp.float32
BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Config:
    """Measured on an H200 at Kimi-Linear-48B dims (scripts/gpu/prefill_attention.py, docs/PERF.md): bm 32,
    bn 64, 4 warps 2.66 ms (4096-token prompt) and 8.03 ms (8 x 1024 tokens after 3072 slots) against XLA's
    5.25 and 11.94; bm 64 bn 32 8 warps 3.31-3.49 / 10.7-12.4; bm 64 bn 64 8 warps 1 stage 2.93 / 10.4;
    bn 16 slower than XLA."""
    bm: int = 32  # (token, head) rows per program (form "heads": tokens of one head): the dots' M
    bn: int = 64  # cache slots per inner step
    num_warps: int = 4
    num_stages: int = 2
    form: str = "absorbed"  # or "heads" (per-head keys and values expanded from the latents: `choose`)


# The per-head form expands every cache slot's keys and values ([B·H, S, N + V] bf16) before its kernel, so it pays
# where the chunk is a large part of the cache: `choose` takes it when S <= HEADS_MAX_RATIO · T, S the cache's
# allocated slots (the prompt plus the new tokens rounded up to 512: the expansion covers them all, filled or not),
# and the expansion's float32 keys and values fit in HEADS_MAX_BYTES.  Measured on an H200 at Kimi-Linear-48B dims
# (2026-12-03, eleventh session; scripts/gpu/prefill_attention.py), caches full to the chunk's end: a 4096-token
# prompt (S = T) 1.018 ms against the absorbed form's 2.817 (XLA 5.514); 8 x 1024 tokens after 3072 cached (S = 4T)
# 3.976 ms against 8.287 (XLA 12.283); and in `bench generate` (S = 4.5T at B = 8, chunks of 1024; S = 1.1T at
# B = 1) the first token 7-8% sooner.  The ratio 8 is beyond what was timed: at S = 4T the expansion was a small part
# of the 2.1x win.  A cache mostly empty (a long allocation, a prompt's first chunks) is not yet timed.  0: never.
HEADS_MAX_RATIO = 8
HEADS_MAX_BYTES = 2 << 30
HEADS = Config(bm=64, bn=64, form="heads")  # the tiles of those two rows (compiled-tested on the H200)


def choose(qn_BTHN, qpe_BTHP, kv_BSR, wkvb_HXR) -> Config:
    """The config `attention_device` runs without one: `HEADS` where the chunk's T tokens are at least 1 /
    HEADS_MAX_RATIO of the cache's S allocated slots, the expansion's float32 keys and values [B·H, S, N + V] take at
    most HEADS_MAX_BYTES and the per-head form fits these widths; else the absorbed form's defaults (`Config()`)."""
    B, T, H, N = qn_BTHN.shape
    S, X = kv_BSR.shape[1], wkvb_HXR.shape[1]
    if (HEADS_MAX_RATIO and S <= HEADS_MAX_RATIO * T and B * H * S * X * 4 <= HEADS_MAX_BYTES
            and _fits(qn_BTHN, qpe_BTHP, kv_BSR, wkvb_HXR, HEADS) is None):
        return HEADS
    return Config()


def latent_attention_prefill(ql_BTHR: jax.Array, qpe_BTHP: jax.Array, kv_BSR: jax.Array, limit_BT: jax.Array,
                             scale: float, **_) -> jax.Array:
    """fp32 [B, T, H, R]: each (token, head)'s softmax over cache slots s <= limit[b, t] of
    (ql·c_kv_s + q_pe·k_pe_s)·scale, applied to c_kv (R = kv_lora_rank: the first R of each entry)."""
    S, R = kv_BSR.shape[1], ql_BTHR.shape[-1]
    c = kv_BSR.astype(F32)
    score = (jnp.einsum("bthr,bsr->bths", ql_BTHR.astype(F32), c[..., :R])
             + jnp.einsum("bthp,bsp->bths", qpe_BTHP.astype(F32), c[..., R:])) * scale
    mask = jnp.arange(S)[None, None, :] <= limit_BT[..., None]
    p = jax.nn.softmax(jnp.where(mask[:, :, None, :], score, -jnp.inf), axis=-1)
    return jnp.einsum("bths,bsr->bthr", p, c[..., :R])


def _softmax_step(m, l, acc, s, val):
    """One slot block of the online softmax: running max m [bm], sum l [bm] and acc [bm, X] (fp32) after the
    masked scores s [bm, bn] (fp32; NEG where masked) and their values val [bn, X] (bf16: p rounded to it)."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None])
    corr = jnp.exp(m - m_new)
    pv = jax.lax.dot_general(p.astype(val.dtype), val, (((1,), (0,)), ((), ())), preferred_element_type=F32)
    return m_new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + pv


def _kernel(lim_ref, ql_ref, qpe_ref, kv_ref, o_ref, *, R: int, P: int, S: int, scale: float, c: Config):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b, i = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(pl.multiple_of(i * c.bm, c.bm), c.bm)
    lim = lim_ref[b, rows]  # int32 [bm]: each row sees slots <= lim
    ql, qpe = ql_ref[b, rows], qpe_ref[b, rows]  # bf16 [bm, R], [bm, P]
    end = jnp.minimum(jnp.max(lim) + 1, S)  # this tile reads slots [0, end)
    steps = (end + c.bn - 1) // c.bn

    def body(j, carry):
        m, l, acc = carry
        pos = j * c.bn
        slot = pos + jnp.arange(c.bn)
        ok = slot < end
        cv = plgpu.load(kv_ref.at[b, pl.ds(pos, c.bn), pl.ds(0, R)], mask=ok[:, None], other=0.0)  # bf16 [bn, R]
        kpe = plgpu.load(kv_ref.at[b, pl.ds(pos, c.bn), pl.ds(R, P)], mask=ok[:, None], other=0.0)
        s = (dot_nt(ql, cv) + dot_nt(qpe, kpe)) * scale  # fp32 [bm, bn]
        return _softmax_step(m, l, acc, jnp.where(slot[None, :] <= lim[:, None], s, NEG), cv)

    init = (jnp.full((c.bm,), NEG, F32), jnp.zeros((c.bm,), F32), jnp.zeros((c.bm, R), F32))
    m, l, acc = jax.lax.fori_loop(0, steps, body, init)
    o_ref[b, rows] = acc / l[:, None]  # every row sees slot 0 at least (limit >= 0): l >= 1


def mla_prefill(ql_BTHR, qpe_BTHP, kv_BSR, limit_BT, scale: float, config: Config | None = None,
                interpret: bool = False) -> jax.Array:
    """The reference's function with bf16 dot operands: fp32 [B, T, H, R]."""
    from jax.experimental import pallas as pl

    c = config or Config()
    B, T, H, R = ql_BTHR.shape
    S, P = kv_BSR.shape[1], qpe_BTHP.shape[-1]
    N = T * H
    n = -(-N // c.bm) * c.bm  # rows padded to whole tiles (padded rows: limit 0, dropped)
    pad = ((0, 0), (0, n - N), (0, 0))
    ql = jnp.pad(ql_BTHR.astype(kv_BSR.dtype).reshape(B, N, R), pad)
    qpe = jnp.pad(qpe_BTHP.astype(kv_BSR.dtype).reshape(B, N, P), pad)
    lim = jnp.pad(jnp.repeat(jnp.maximum(limit_BT, 0).astype(jnp.int32), H, axis=1), ((0, 0), (0, n - N)))
    kw = triton_params(c.num_warps, c.num_stages, interpret)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_kernel, R=R, P=P, S=S, scale=scale, c=c), grid=(B, n // c.bm),
        in_specs=[any_] * 4, out_specs=any_, out_shape=jax.ShapeDtypeStruct((B, n, R), F32),
        interpret=interpret, name="mla_prefill", **kw)(lim, ql, qpe, kv_BSR)
    return out[:, :N].reshape(B, T, H, R)


def attention(qn_BTHN: jax.Array, qpe_BTHP: jax.Array, kv_BSR: jax.Array, limit_BT: jax.Array, wkvb_HXR: jax.Array,
              scale: float, latent=latent_attention_prefill, **_) -> jax.Array:
    """The prefill's MLA attention, fp32 [B, T, H, V]: the absorbed query ql = W_UK[h]ᵀ q_nope, the latent
    attention `latent(ql, q_pe, kv, limit, scale)` (default `latent_attention_prefill`; the absorbed kernel
    passes itself), then W_UV[h] (W_kvb[h] = [W_UK ; W_UV], fp32 [H, N + V, R]).  The jnp reference of
    `attention_device` (and the CPU path)."""
    n = qn_BTHN.shape[-1]
    ql = jnp.einsum("bthn,hnr->bthr", qn_BTHN, wkvb_HXR[:, :n])
    return jnp.einsum("bthr,hvr->bthv", latent(ql, qpe_BTHP, kv_BSR, limit_BT, scale), wkvb_HXR[:, n:])


def _heads_kernel(lim_ref, qn_ref, qpe_ref, k_ref, kpe_ref, v_ref, o_ref, *, S: int, H: int, scale: float, c: Config):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    bh, i = pl.program_id(0), pl.program_id(1)
    b = bh // H
    rows = pl.ds(pl.multiple_of(i * c.bm, c.bm), c.bm)
    lim = lim_ref[b, rows]  # int32 [bm]: token t sees slots <= lim
    qn, qpe = qn_ref[bh, rows], qpe_ref[bh, rows]  # bf16 [bm, N], [bm, P]
    end = jnp.minimum(jnp.max(lim) + 1, S)
    steps = (end + c.bn - 1) // c.bn
    Vd = v_ref.shape[-1]

    def body(j, carry):
        m, l, acc = carry
        pos = j * c.bn
        slot = pos + jnp.arange(c.bn)
        ok = (slot < end)[:, None]
        kn = plgpu.load(k_ref.at[bh, pl.ds(pos, c.bn), :], mask=ok, other=0.0)  # bf16 [bn, N]
        kp = plgpu.load(kpe_ref.at[b, pl.ds(pos, c.bn), :], mask=ok, other=0.0)  # [bn, P], shared by the heads
        vv = plgpu.load(v_ref.at[bh, pl.ds(pos, c.bn), :], mask=ok, other=0.0)  # [bn, V]
        s = (dot_nt(qn, kn) + dot_nt(qpe, kp)) * scale
        return _softmax_step(m, l, acc, jnp.where(slot[None, :] <= lim[:, None], s, NEG), vv)

    init = (jnp.full((c.bm,), NEG, F32), jnp.zeros((c.bm,), F32), jnp.zeros((c.bm, Vd), F32))
    m, l, acc = jax.lax.fori_loop(0, steps, body, init)
    o_ref[bh, rows] = acc / l[:, None]


def heads_prefill(qn_BTHN, qpe_BTHP, kv_BSR, limit_BT, wkvb_HXR, scale: float, config: Config | None = None,
                  interpret: bool = False) -> jax.Array:
    """`attention` with per-head keys W_UK[h] c_s and values W_UV[h] c_s expanded from the latents (bf16,
    [B·H, S, ·]) and a causal flash kernel per (row, head, token tile): (N + P + V) wide dots per slot
    instead of the absorbed form's (R + P + R), 1088 -> 320 at Kimi-Linear-48B.  fp32 [B, T, H, V]."""
    from jax.experimental import pallas as pl

    c = config or Config(form="heads")
    B, T, H, N = qn_BTHN.shape
    S, P = kv_BSR.shape[1], qpe_BTHP.shape[-1]
    R = kv_BSR.shape[-1] - P
    dt = kv_BSR.dtype
    lat = kv_BSR[..., :R].astype(F32)
    k = jnp.einsum("bsr,hnr->bhsn", lat, wkvb_HXR[:, :N]).astype(dt).reshape(B * H, S, N)
    v = jnp.einsum("bsr,hvr->bhsv", lat, wkvb_HXR[:, N:]).astype(dt).reshape(B * H, S, -1)
    Vd = v.shape[-1]
    t = -(-T // c.bm) * c.bm  # tokens padded to whole tiles (padded tokens: limit 0, dropped)

    def heads_first(x):  # [B, T, H, X] -> bf16 [B·H, t, X]
        x = jnp.moveaxis(x.astype(dt), 2, 1).reshape(B * H, T, -1)
        return jnp.pad(x, ((0, 0), (0, t - T), (0, 0)))

    lim = jnp.pad(jnp.maximum(limit_BT, 0).astype(jnp.int32), ((0, 0), (0, t - T)))
    kw = triton_params(c.num_warps, c.num_stages, interpret)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_heads_kernel, S=S, H=H, scale=scale, c=c), grid=(B * H, t // c.bm),
        in_specs=[any_] * 6, out_specs=any_, out_shape=jax.ShapeDtypeStruct((B * H, t, Vd), F32),
        interpret=interpret, name="mla_prefill_heads", **kw)(lim, heads_first(qn_BTHN), heads_first(qpe_BTHP), k,
                                                             kv_BSR[..., R:], v)
    return jnp.moveaxis(out[:, :T].reshape(B, H, T, Vd), 1, 2)


def attention_device(qn_BTHN, qpe_BTHP, kv_BSR, limit_BT, wkvb_HXR, scale: float, config: Config | None = None,
                     interpret: bool = False) -> jax.Array:
    """`attention` through a kernel: the absorbed flash kernel (`mla_prefill`, the default) or the per-head
    one (`heads_prefill`, config.form == "heads"); without a config, `choose`'s."""
    c = config or choose(qn_BTHN, qpe_BTHP, kv_BSR, wkvb_HXR)
    if c.form == "heads":
        return heads_prefill(qn_BTHN, qpe_BTHP, kv_BSR, limit_BT, wkvb_HXR, scale, c, interpret)
    return attention(qn_BTHN, qpe_BTHP, kv_BSR, limit_BT, wkvb_HXR, scale,
                     latent=functools.partial(mla_prefill, config=c, interpret=interpret))


def fits(qn_BTHN, qpe_BTHP, kv_BSR, limit_BT, wkvb_HXR, scale, config: Config | None = None, **_) -> str | None:
    return _fits(qn_BTHN, qpe_BTHP, kv_BSR, wkvb_HXR, config or choose(qn_BTHN, qpe_BTHP, kv_BSR, wkvb_HXR))


def _fits(qn_BTHN, qpe_BTHP, kv_BSR, wkvb_HXR, c: Config) -> str | None:
    P = qpe_BTHP.shape[-1]
    R, N = kv_BSR.shape[-1] - P, qn_BTHN.shape[-1]
    V = wkvb_HXR.shape[1] - N
    if kv_BSR.dtype != BF16:
        return (f"mla_prefill kernel runs its dots on the tensor cores over the bf16 cache as stored, got a "
                f"{jnp.dtype(kv_BSR.dtype).name} cache")
    if c.form not in ("absorbed", "heads"):
        return f"mla_prefill kernel: form must be 'absorbed' or 'heads', got {c.form!r}"
    widths = (("kv_lora_rank", R), ("qk_rope_head_dim", P)) if c.form == "absorbed" else (
        ("qk_nope_head_dim", N), ("qk_rope_head_dim", P), ("v_head_dim", V))
    for name, v in widths:
        if not pow2(v) or v < 16:
            return f"mla_prefill kernel needs {name} a power of two >= 16 (Triton blocks, tl.dot), got {v}"
    if not (pow2(c.bm) and pow2(c.bn)) or c.bm < 16 or c.bn < 16:
        return f"mla_prefill kernel: bm {c.bm} and bn {c.bn} are the dots' M and N/K: powers of two >= 16"
    if c.form == "heads":  # the same bounds with the per-head widths: keys N + P wide, values and output V
        return tile_limits("mla_prefill", f"{c.bm} rows", c.bm, c.bn, max(N, V), P, c.num_warps, "smaller bm / bn",
                           "smaller bm or more warps")
    return tile_limits("mla_prefill", f"{c.bm} rows", c.bm, c.bn, R, P, c.num_warps, "smaller bm / bn",
                       "smaller bm or more warps")


# Proven on an H200 (2026-12-02, docs/PERF.md) in its default, absorbed form: compiled tests at 48B's heads and
# latent widths passed, and at the preset dims faster than XLA's path in the same run with the default tiles
# (1.97x at a 4096-token prompt, 1.49x for 8 x 1024 tokens after a 3072-slot prefix).  The per-head form
# (Config(form="heads")): compiled tests at the same dims passed and it beat the absorbed form 2.08-2.77x in the same
# run (2026-12-03, eleventh session); `choose` takes it where the chunk is at least an eighth of the cache.
register(Kernel("mla_prefill", attention, attention_device, platforms=("gpu",), fits=fits,
                measured="Kimi-Linear-48B dims, the per-head form `choose` takes there: 5.42x XLA at a 4096-token prompt "
                         "(1.018 vs 5.514 ms), 3.09x at 8 x 1024 tokens after 3072 cached (3.976 vs 12.283 ms); the "
                         "absorbed form 1.96x and 1.48x (H200, jax 0.11.2, 2026-12-03)"))
