"""The newest device kernels lowered to Triton IR for an sm_90 on the CPU, at the Kimi-Linear-48B preset's real
dims (jaxk3.tools.triton_lowering): a block that is not a power of two, an unsupported primitive or a bad index
fails here, before a GPU call (a B > 1 planning kernel of moe_experts_routed, since removed, did: a 24-slot tile).  Shapes only:
nothing is allocated.  What lowering cannot see (PTX register and shared-memory limits, speed) is the GPU's.

Each kernel's first GPU call also runs its `gpu`-marked tests (tests/test_kernels.py, tests/test_gemv.py); this
covers the forms whose GPU run is pending or recent."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxk3.tools.triton_lowering import lower

S = SD = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _cfg48():
    from jaxk3.tools.bench_decode import load_config

    return load_config("kimi-linear-48b")


@pytest.mark.parametrize("E,B,residual", [(64, 1, False), (256, 1, False), (64, 1, True), (256, 1, True)])
def test_moe_experts_routed_lowers(E, B, residual):
    """The routed form at the 48B's dims lowers to Triton (kernel 1 and 2); handed the residual stream, with kernel 2
    adding it itself (moe_experts.RESIDUAL_IN_DOWN: 576 programs of 4 rows, I in one tile)."""
    from jaxk3.kernels import moe_experts as ME
    from jaxk3.layers import moe

    cfg = dataclasses.replace(_cfg48(), num_experts=E)
    I, L = cfg.moe_intermediate_size, cfg.hidden_size
    w = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=None, experts_w3=None,
                       experts_w2=S((E, L, I), BF16), experts_w13=S((E, 2 * I, L), BF16))
    shared = ME.SharedMLP(S((2 * I, L), BF16), S((L, I), BF16))
    z, logits, bias = S((B, L), BF16), S((B, E), jnp.float32), S((E,), jnp.float32)
    h = S((B, L), BF16) if residual else None
    assert ME.routed_fits(cfg, w, z, logits, bias, shared=shared, only_where_faster=False, residual=h) is None
    if residual:
        assert ME.RESIDUAL_IN_DOWN and ME._fold_config(ME._resolve(ME.Config(), B, L, I, L), B, False, h, L, I)
        n = lower(lambda w, z, lg, b, sh, h: ME.experts_routed(cfg, w, z, lg, b, shared=sh, residual=h), w, z, logits,
                  bias, shared, h)
    else:
        n = lower(lambda w, z, lg, b, sh: ME.experts_routed(cfg, w, z, lg, b, shared=sh), w, z, logits, bias, shared)
    assert n == 2  # kernel 1 and 2


@pytest.mark.parametrize("B,c", [(1, dict(scale="group", x_f32=True)), (8, dict(scale="group", x_f32=True)),
                                 (8, dict(mx_dot=True)), (3, dict(mx_dot=True, decode="select")),
                                 (1, dict(decode="asm")), (8, dict(mx_dot=True, decode="asm")),
                                 (8, dict(f16=True)), (3, dict(f16=True, decode="select"))])
def test_moe_experts_group_scale_lowers(B, c):
    """MXFP4 experts with the scale per group and the input widened by XLA (`Config(scale="group", x_f32=True)`, B 1
    and 8), on the tensor cores (`mx_dot`, B 3 and 8) and on float16 tensor cores (`f16`, the stacks marked: its
    inline PTX with float16 results) at K3's TP 2 share (64 experts kept)."""
    from jaxk3.config import KimiK3Config
    from jaxk3.kernels import moe_experts as ME
    from jaxk3.layers import moe

    cfg = dataclasses.replace(KimiK3Config.k3(), num_experts=64)
    I, L, k = cfg.moe_intermediate_size // 2, cfg.moe_hidden, cfg.num_experts_per_token
    u8 = jnp.uint8

    def packed(O, In):
        return ME.MXFP4(S((64, O, In // 2), u8), S((64, O, In // 32), u8), f16=bool(c.get("f16")))
    w = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=packed(I, L), experts_w2=packed(L, I),
                       experts_w3=packed(I, L))
    z, wk, ids = S((B, L), BF16), S((B, k), jnp.float32), S((B, k), jnp.int32)
    c = ME.Config(**c)
    assert ME.fits(cfg, w, z, wk, ids, config=c, only_where_faster=False) is None
    assert lower(lambda w, z, wk, ids: ME.experts(cfg, w, z, wk, ids, config=c), w, z, wk, ids) == 2


def test_gemv_gnorm_lowers():
    from jaxk3.kernels import gemv as G

    cfg = _cfg48()
    C, d, D = cfg.kda_dim, cfg.kda_head_dim, cfg.hidden_size
    x, g, w = S((1, C), jnp.float32), S((d,), jnp.float32), S((D, C), BF16)
    assert G.gnorm_fits(x, x, g, 1e-5, w, BF16, only_where_faster=False) is None
    assert lower(lambda x, z, g, w: G.gemv_gnorm(x, z, g, 1e-5, w, BF16), x, x, g, w) == 1


@pytest.mark.parametrize("gated,ring,B", [(True, False, 1), (False, False, 1), (False, True, 1), (True, True, 8)])
def test_kda_decode_in_lowers(gated, ring, B):
    """`ring`: the conv cache as the ring of K slots, read and written at each row's position (kda_decode.RING)."""
    from jaxk3.kernels import kda_decode as KD

    cfg = _cfg48()
    C, H, d, K = cfg.kda_dim, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    f32 = jnp.float32
    cw = KD.CoreWeights(conv_3CK=S((3, C, K), f32), dt_bias_C=S((C,), f32), A_log_H=S((H,), f32), o_norm_K=S((d,), f32))
    args = (S((B, 3 * C + 2 * d + H), f32), S((2, C, d), BF16), S((B, 3, C, K if ring else K - 1), BF16), cw,
            S((B, H, d, d), f32), S((B,), jnp.bool_))
    kw = dict(pos_B=S((B,), jnp.int32)) if ring else {}
    assert KD.fused_fits(cfg, *args, only_where_faster=False, **kw) is None
    assert lower(lambda *a: KD.kda_decode_in(cfg, *a[:6], gated=gated, pos_B=a[6] if ring else None), *args,
                 *kw.values()) == 1


def test_kda_decode_ring_lowers():
    """The projections' form (K3, checkpoint layout) with the ring, at K3's TP 8 share."""
    from jaxk3.config import KimiK3Config
    from jaxk3.kernels import kda_decode as KD

    cfg = KimiK3Config.k3()
    H, d, K = cfg.kda_num_heads // 8, cfg.kda_head_dim, cfg.short_conv_kernel_size
    C, f32 = H * d, jnp.float32
    cw = KD.CoreWeights(conv_3CK=S((3, C, K), f32), dt_bias_C=S((C,), f32), A_log_H=S((H,), f32), o_norm_K=S((d,), f32))
    args = (S((2, 3, C), BF16), S((2, 3, C, K), BF16), cw, S((2, C), f32), S((2, H), f32), S((2, C), f32),
            S((2, H, d, d), f32), S((2,), jnp.bool_), S((2,), jnp.int32))
    assert KD.fits(cfg, *args[:8], pos_B=args[8]) is None
    assert lower(lambda *a: KD.kda_decode(cfg, *a[:8], pos_B=a[8]), *args) == 1


# tp: K3's heads at that TP (12 at TP 8: padded); S 3072: the engine's caches come in multiples of 512, so the
# attention's parts need not be a power of two (48 here)
@pytest.mark.parametrize("B,tp,S", [(1, None, 4096), (8, None, 4096), (1, 8, 4096), (1, None, 3072)])
def test_mla_decode_uv_lowers(B, tp, S):
    from jaxk3.config import KimiK3Config
    from jaxk3.kernels import mla_decode as MD

    cfg = _cfg48() if tp is None else KimiK3Config.k3()
    H, R, P, n, v = (cfg.num_attention_heads // (tp or 1), cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                     cfg.qk_nope_head_dim, cfg.v_head_dim)
    args = (SD((B, H, R), jnp.float32), SD((B, H, P), jnp.float32), SD((B, S, R + P), BF16), SD((B,), jnp.int32))
    wkvb = SD((H, n + v, R), BF16)
    assert MD.uv_fits(*args, 0.07, wkvb, n, only_where_faster=False) is None
    assert lower(lambda q, p, kv, ln, w: MD.mla_decode_uv(q, p, kv, ln, 0.07, w, n), *args, wkvb) == 2


@pytest.mark.parametrize("B,k3,gathered", [(1, False, False), (8, False, False), (1, True, False), (1, True, True)])
def test_mla_prep_lowers(B, k3, gathered):
    """The 48B's serving layout ([c_kv | k_pe | q] rows of one GEMV output) and K3 at TP 8 (12 heads; the query from
    q_b_proj's own output, the latent after q_a's rows, or `gathered`: the bf16 latent shard_latent's gather gives)."""
    from jaxk3.config import KimiK3Config
    from jaxk3.kernels import mla_prep as MP

    cfg = KimiK3Config.k3() if k3 else _cfg48()
    H, R, P, n, v = (cfg.num_attention_heads // (8 if k3 else 1), cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                     cfg.qk_nope_head_dim, cfg.v_head_dim)
    f32 = jnp.float32
    L, Q = R + P, H * (n + P)
    y = SD((B, (cfg.q_lora_rank or 0) + L + (0 if k3 else Q)), f32)
    q_src, q_off, kv_off = (SD((B, Q), f32), 0, cfg.q_lora_rank) if k3 else (y, L, 0)
    if gathered:
        y, kv_off = SD((B, L), BF16), 0
    rest = (SD((H, n + v, R), BF16), n, SD((R,), f32), 1e-6, SD((B, 4096, L), BF16), SD((B,), jnp.int32),
            SD((B,), jnp.bool_), BF16)
    assert MP.fits(q_src, q_off, y, kv_off, *rest, out_dtype=BF16, only_where_faster=False) is None
    assert lower(lambda q, y, w, nw, kv, ln, ok: MP.mla_prep(q, q_off, y, kv_off, w, n, nw, 1e-6, kv, ln, ok, BF16,
                                                             out_dtype=BF16), q_src, y, *rest[:1], rest[2], *rest[4:7]) == 1


def test_mla_prep_lowers_from_partial_sums():
    """`mla_prep.PARTIALS`: the 48B's in_proj partial sums over its three K splits [3, 1, 6720] as both sources."""
    from jaxk3.kernels import mla_prep as MP

    cfg = _cfg48()
    H, R, P, n, v = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    f32 = jnp.float32
    p = SD((3, 1, R + P + H * (n + P)), f32)
    rest = (SD((H, n + v, R), BF16), SD((R,), f32), SD((1, 4096, R + P), BF16), SD((1,), jnp.int32), SD((1,), jnp.bool_))
    assert MP.fits(p, R + P, p, 0, rest[0], n, rest[1], 1e-6, *rest[2:], BF16, out_dtype=BF16) is None
    assert lower(lambda p, w, nw, kv, ln, ok: MP.mla_prep(p, R + P, p, 0, w, n, nw, 1e-6, kv, ln, ok, BF16,
                                                          out_dtype=BF16), p, *rest) == 1


@pytest.mark.parametrize("backend,bn,ok", [("mosaic", 128, True), ("mosaic_ws", 128, True), ("mosaic_ws", 256, False)])
def test_moe_grouped_mosaic_lowers(backend, bn, ok):
    """The prefill MoE's Mosaic GPU kernels (moe_grouped `Config(backend=...)`) exported for CUDA at the 48B prefill's
    dims (4096 tokens x 8 of 256 experts): Mosaic GPU compiles its kernels while lowering, so a tiling whose pipeline
    does not fit an H200's 232,448 bytes of shared memory is refused here, as the GPU refused it (docs/PERF.md,
    sixteenth session: warp-specialised bn 256 asks 327,744)."""
    from jaxk3.kernels import moe_grouped as G
    from jaxk3.layers import moe
    from jaxk3.tools.triton_lowering import abstract_sm90

    cfg = dataclasses.replace(_cfg48(), num_experts=256)
    I, L, k, N = cfg.moe_intermediate_size, cfg.moe_hidden, cfg.num_experts_per_token, 4096
    w = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=None, experts_w3=None,
                       experts_w2=S((256, L, I), BF16), experts_w13=S((256, 2 * I, L), BF16))
    args = (w, S((N, L), BF16), S((N, k), jnp.float32), S((N, k), jnp.int32))
    c = G.Config(bm=64, bn=bn, bk=64, num_stages=4, backend=backend, width=4)
    assert G.fits(cfg, *args, config=c) is None
    abstract_sm90()
    export = jax.export.export(
        jax.jit(lambda w, z, wk, ids: G.grouped(cfg, w, z, wk, ids, config=c)), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(n)
                         for n in ("mosaic_gpu_v2", "mosaic_gpu", "__gpu$xla.gpu.triton")])
    if ok:
        assert export(*args).mlir_module().count("mosaic_gpu") >= 2  # gate|up and down
    else:
        with pytest.raises(Exception, match="exceeds available shared memory"):
            export(*args)
