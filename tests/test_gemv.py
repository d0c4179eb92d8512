"""The decode GEMV kernel (jaxk3.kernels.gemv) against XLA's dot.

Interpret mode (the CPU) on small shapes, both layouts, both multiply variants, K splits; compiled
on a GPU at the presets' projection shapes.  Tolerance: both paths take bf16 products summed in
fp32; the kernel sums in another order (tiles, then K splits), so results agree to fp32 rounding of
a K-term sum (~K·2^-24 relative to the sum of |terms|, < 1e-5 of max|y| here); a wrong tile, row or
split is off by O(1).

With a norm weight (the RMSNorm prologue) the kernel sums x² in another order than XLA's reduce, so
the normed input's scale differs in its last fp32 bits, which can move an element's rounding to the
activation dtype by one bf16 ulp (2^-8 relative): the outputs then agree to 2^-8 of the sum of
|w·xn| in the worst case; tested at 4e-3 of max|y| (a wrong row scale, a missing weight or a wrong
row is off by O(1)), and most outputs (no rounding moved) to the plain GEMV's 1e-5.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxk3 import kernels
from jaxk3.kernels import gemv as G


def _xw(B, N, K, seed=0):
    r = np.random.default_rng(seed + B + N + K)
    return jnp.asarray(r.standard_normal((B, K)), jnp.bfloat16), jnp.asarray(r.standard_normal((N, K)) * 0.05, jnp.bfloat16)


@pytest.mark.parametrize("B,N,K", [(1, 64, 512), (3, 32, 2304), (8, 44, 384)])  # 44: bn does not divide N
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("cfg", [None, G.Config(bn=16, bk=64, splits=2, dot=True), G.Config(bn=16, bk=128)])
def test_gemv_kernel_matches_reference(B, N, K, layout, cfg):
    x, w = _xw(B, N, K)
    ww = w if layout == "nk" else w.T
    why = G.fits(x, ww, layout, cfg, only_where_faster=False)
    if why:
        assert B > 1 and not cfg.dot and "dot variant" in why
        return
    got = np.asarray(G.gemv(x, ww, layout, cfg, interpret=True))
    ref = np.asarray(G.reference(x, ww, layout))
    assert got.shape == ref.shape == (B, N) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("N,K", [(12576, 2304), (6720, 2304), (2048, 2304), (18432, 2304), (6284, 7168), (64, 2304),
                                 (256, 2304)])
def test_gemv_norm_prologue_on_gpu(B, N, K):
    """Compiled with the RMSNorm prologue at the fused input projections' shapes (the blocks' first
    GEMVs, which take the residual stream and its norm weight), against XLA's norm then dot; rows of
    different scale (a row normed by another's scale is off by O(1))."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    x, w = _xw(B, N, K)
    r = np.random.default_rng(1)
    x = (x.astype(jnp.float32) * jnp.asarray(10.0 ** r.uniform(-1, 2, (B, 1)), jnp.float32)).astype(jnp.bfloat16)
    g = jnp.asarray(r.uniform(0.5, 1.5, K), jnp.bfloat16)
    assert kernels.REGISTRY["gemv_norm"].fits(x, w, g, 1e-5, only_where_faster=False) is None
    f = jax.jit(lambda x, w, g: kernels.call("gemv_norm", x, w, g, 1e-5, mode="on"))
    got = np.asarray(f(x, w, g))
    ref = np.asarray(G.reference(x, w, norm_w=g, eps=1e-5))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * np.abs(ref).max())
    assert np.mean(np.abs(got - ref) <= 1e-5 * np.abs(ref).max()) > 0.9


@pytest.mark.parametrize("B,N,K,cfg", [(1, 64, 512, G.Config(bn=16, bk=128, splits=2)),
                                       (1, 44, 384, G.Config(bn=16, bk=64, splits=3)),
                                       (3, 32, 2304, G.Config(bn=16, bk=256, splits=3, dot=True)),
                                       (8, 64, 512, None)])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_gemv_norm_prologue_matches_reference(B, N, K, cfg, layout):
    """x normed in the kernel (RMSNorm with a weight, rows of very different scale) equals XLA's
    norm then the GEMV; the raw x is not the normed one (else the prologue could be a no-op)."""
    x, w = _xw(B, N, K)
    r = np.random.default_rng(7)
    x = (x.astype(jnp.float32) * jnp.asarray(10.0 ** r.uniform(-2, 2, (B, 1)), jnp.float32)).astype(jnp.bfloat16)
    g = jnp.asarray(r.uniform(0.5, 1.5, K), jnp.bfloat16)
    ww = w if layout == "nk" else w.T
    assert G.fits(x, ww, layout, cfg, only_where_faster=False, norm_w=g, eps=1e-5) is None
    got = np.asarray(G.gemv(x, ww, layout, cfg, interpret=True, norm_w=g, eps=1e-5))
    ref = np.asarray(G.reference(x, ww, layout, norm_w=g, eps=1e-5))
    assert got.shape == ref.shape == (B, N)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * scale)
    assert np.mean(np.abs(got - ref) <= 1e-5 * scale) > 0.9
    raw = np.asarray(G.reference(x, ww, layout))
    assert np.abs(raw - ref).max() > 0.1 * scale
    assert "norm weight must be [K]" in G.fits(x, ww, layout, cfg, norm_w=g[:-1], eps=1e-5)
    # sums=True: the kernel's partial sums over its K splits, whose sum is its output (bitwise: the same adds)
    p = np.asarray(G.gemv(x, ww, layout, cfg, interpret=True, norm_w=g, eps=1e-5, sums=True))
    assert p.shape == ((cfg.splits if cfg else G.config_for(B, N, K, layout).splits), B, N)
    np.testing.assert_array_equal(np.asarray(jnp.sum(jnp.asarray(p), axis=0)), got)
    assert np.asarray(G.reference(x, ww, layout, norm_w=g, eps=1e-5, sums=True)).shape == (1, B, N)


@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_gemv_norm_of_an_fp32_row(gpu):
    """K3's latent up projection (moe.LATENT_NORM_IN_UP): x is the experts' fp32 latent row, normed in fp32 in the
    prologue and rounded to the weights' bf16 after the norm, as XLA's rms_norm then the cast: against the reference
    as the bf16 prologue's test (4e-3 of max|y|, most outputs to 1e-5); the row un-normed is off by O(1).  Interpret
    mode on a small shape; compiled (gpu) at K3's TP 1 shape, 7168 x 3584."""
    if gpu and jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    N, K = (7168, 3584) if gpu else (48, 512)
    r = np.random.default_rng(5)
    x = jnp.asarray(r.standard_normal((1, K)) * 30.0, jnp.float32)
    w = jnp.asarray(r.standard_normal((N, K)) * 0.05, jnp.bfloat16)
    g = jnp.asarray(r.uniform(0.5, 1.5, K), jnp.bfloat16)
    if gpu:
        got = np.asarray(jax.jit(lambda x, w, g: kernels.call("gemv_norm", x, w, g, 1e-5, mode="on"))(x, w, g))
    else:
        got = np.asarray(G.gemv(x, w, "nk", G.Config(bn=16, bk=128, splits=2), interpret=True, norm_w=g, eps=1e-5))
    ref = np.asarray(G.reference(x, w, norm_w=g, eps=1e-5))
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * scale)
    assert np.mean(np.abs(got - ref) <= 1e-5 * scale) > 0.9
    assert np.abs(np.asarray(G.reference(x, w)) - ref).max() > 0.1 * scale


def test_gemv_fits_and_selection():
    x, w = _xw(1, 64, 512)
    assert G.fits(x, w, only_where_faster=False) is None
    assert "not measured" in G.fits(x, w)
    assert "B <= 8" in G.fits(jnp.zeros((9, 512), jnp.bfloat16), w)
    assert "bf16" in G.fits(x, w.astype(jnp.float32))
    assert "K = 256" in G.fits(jnp.zeros((1, 256), jnp.bfloat16), w)
    assert "must divide" in G.fits(x, w, config=G.Config(bn=48))
    assert "bn fit in N 64" in G.fits(x, w, config=G.Config(bn=128))
    assert "layout" in G.fits(x, w, layout="xx")
    assert kernels.explain("gemv", x, w, platform="cpu").startswith("reference")
    c = G.default_config(1, 2304, 4096)
    assert (2304 // c.bn) * c.splits >= 4 * 132 and 4096 % (c.splits * c.bk) == 0
    # auto takes the kernel only where it beat XLA's dot on the H200 (shapes only: nothing allocated)
    s = jax.ShapeDtypeStruct
    win, lose = (1, 18432, 2304), (1, 2304, 4096)
    for (B, N, K), ok in ((win, True), (lose, False)):
        xs, ws = s((B, K), jnp.bfloat16), s((N, K), jnp.bfloat16)
        how = kernels.explain("gemv", xs, ws, platform="gpu")
        assert how.startswith("device") if ok else "XLA's dot is as fast" in how, how
        assert G.fits(xs, ws, only_where_faster=False) is None
    assert kernels.active("gpu")["gemv"]
    # a fused projection a few rows longer than a measured shape takes that shape's verdict and config
    near = G.measured(1, 12352, 2304)
    assert near[0] == (1, 12288, 2304) and G.prefer_kernel(1, 12352, 2304)
    assert G.config_for(1, 12352, 2304).bn == G.CONFIGS[("nk", 1, 12288, 2304)].bn == 32
    assert G.measured(1, 3000, 2304) is None and not G.prefer_kernel(1, 3000, 2304)
    assert G.prefer_kernel(1, 6720, 2304) and not G.prefer_kernel(1, 2048, 2304) and G.prefer_kernel(8, 2048, 2304)
    for (B, N, K), c in G.NORM_CONFIGS.items():  # the normed GEMV's tilings fit their shapes (the router's)
        xs, ws = s((B, K), jnp.bfloat16), s((N, K), jnp.bfloat16)
        assert G.norm_config_for(B, N, K) == c and c.splits == 1
        gn = kernels.REGISTRY["gemv_norm"]
        assert gn.fits(xs, ws, s((K,), jnp.bfloat16), 1e-5, only_where_faster=False) is None
        # the router's shapes were never timed in the step: auto keeps XLA there; kernels="on" runs it
        assert "measured faster" in gn.fits(xs, ws, s((K,), jnp.bfloat16), 1e-5)
        assert kernels.explain("gemv_norm", xs, ws, s((K,), jnp.bfloat16), 1e-5, platform="gpu", mode="on"
                               ).startswith("device")
    # auto takes the normed GEMV at the 48B's first GEMVs for one row (measured); not at B = 8 (the step lost)
    gn = kernels.REGISTRY["gemv_norm"]
    for (B, N, K) in G.NORM_MEASURED:
        args = (s((1, K), jnp.bfloat16), s((N, K), jnp.bfloat16), s((K,), jnp.bfloat16), 1e-5)
        assert gn.fits(*args) is None and kernels.explain("gemv_norm", *args, platform="gpu").startswith("device")
        assert "measured faster" in gn.fits(s((8, K), jnp.bfloat16), *args[1:])
    assert "measured faster" in gn.fits(s((1, 2304), jnp.bfloat16), s((2304, 2304), jnp.bfloat16),
                                        s((2304,), jnp.bfloat16), 1e-5)
    for (l, B, N, K), c in G.CONFIGS.items():  # every tuned config fits its shape
        assert G.fits(s((B, K), jnp.bfloat16), s((N, K), jnp.bfloat16), only_where_faster=False) is None
        assert (B, N, K) in G.MEASURED


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("N,K", [(2304, 2304), (18432, 2304), (2304, 4096), (1536, 7168), (4608, 7168),
                                 (7168, 1536), (2304, 9216),
                                 # the serving layout's fused projections (tests/test_serving.py)
                                 (12576, 2304), (6720, 2304), (2048, 2304), (6284, 7168), (1800, 7168)])
def test_gemv_kernel_on_gpu(B, N, K):
    """Compiled (Triton) at the presets' projection shapes, tuned config, against XLA's dot; the
    output is a fresh array after the allocator's free memory was filled with NaN."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    x, w = _xw(B, N, K)
    why = G.fits(x, w, only_where_faster=False)
    if why:  # a fused shape no tile divides (1800 rows: bn 8 without the dot variant only)
        assert "must divide" in why or "dot variant" in why, why
        pytest.skip(why)
    assert kernels.explain("gemv", x, w, mode="on", only_where_faster=False).startswith("device")
    f = jax.jit(lambda x, w: kernels.call("gemv", x, w, mode="on", only_where_faster=False))
    junk = jnp.full((1 << 27,), jnp.nan, jnp.float32).block_until_ready()
    del junk
    got = np.asarray(f(x, w))
    ref = np.asarray(G.reference(x, w))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_gemv_norm_kernel_on_the_registry_paths():
    """kernels.call('gemv_norm', ...) in every mode reaches a function that takes what the registry passes
    (mode 'on' adds only_where_faster=False): the reference on the CPU, the kernel (interpret) where a
    device path is taken."""
    import dataclasses

    x, w = _xw(1, 64, 512)
    g = jnp.asarray(np.random.default_rng(3).uniform(0.5, 1.5, 512), jnp.bfloat16)
    ref = np.asarray(G.reference(x, w, norm_w=g, eps=1e-5))
    for mode in ("auto", "off"):
        np.testing.assert_array_equal(np.asarray(kernels.call("gemv_norm", x, w, g, 1e-5, mode=mode)), ref)
    k = kernels.REGISTRY["gemv_norm"]
    k.reference(x, w, g, 1e-5, only_where_faster=False)
    got = k.device(x, w, g, 1e-5, interpret=True, only_where_faster=False)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=4e-3 * np.abs(ref).max())
    cpu = dataclasses.replace(k, platforms=("cpu",),
                              device=lambda *a, **kw: k.device(*a, interpret=True, **kw))
    kernels.REGISTRY["gemv_norm"] = cpu
    try:
        got = kernels.call("gemv_norm", x, w, g, 1e-5, mode="on")
    finally:
        kernels.REGISTRY["gemv_norm"] = k
    np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=4e-3 * np.abs(ref).max())


def _gnorm_case(N: int, H: int, d: int, seed: int = 3):
    """KDA's o (fp32, heads of very different scale), its gate z, the norm weight [d] (fp32) and o_proj [N, H·d]."""
    r = np.random.default_rng(seed)
    K = H * d
    x = r.standard_normal((1, H, d)) * 10.0 ** r.uniform(-2, 2, (1, H, 1))
    z = r.standard_normal((1, K)) * 2
    g = r.uniform(0.5, 1.5, d)
    w = r.standard_normal((N, K)) * 0.05
    return (jnp.asarray(x.reshape(1, K), jnp.float32), jnp.asarray(z, jnp.float32), jnp.asarray(g, jnp.float32),
            jnp.asarray(w, jnp.bfloat16))


@pytest.mark.parametrize("N,H,d,cfg", [(64, 8, 32, G.Config(bn=16, bk=64, splits=2)),
                                       (32, 4, 64, G.Config(bn=8, bk=64, splits=1, unroll=True)),
                                       (48, 6, 16, G.Config(bn=16, bk=32, splits=3))])
def test_gemv_gnorm_matches_reference(N, H, d, cfg):
    """o_proj with KDA's gated per-head RMSNorm in its prologue (interpret mode) against gated_rms_norm, the cast to
    bf16 and XLA's dot: the same fp32 expression but for the order of each head's sum of squares, so a normed
    element may round to the neighbouring bf16 value: 4e-3 of max|ref| as gemv_norm's test, and 90% of the outputs
    within 1e-5; without the norm, or with the gate dropped, the result is another one."""
    from jaxk3.kernels.rms_norm import gated_rms_norm

    x, z, g, w = _gnorm_case(N, H, d)
    assert G.gnorm_fits(x, z, g, 1e-5, w, jnp.bfloat16, config=cfg, only_where_faster=False) is None
    got = np.asarray(G.gemv_gnorm(x, z, g, 1e-5, w, jnp.bfloat16, config=cfg, interpret=True))
    ref = np.asarray(G.gnorm_reference(x, z, g, 1e-5, w, jnp.bfloat16))
    assert got.shape == ref.shape == (1, N)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * scale)
    assert np.mean(np.abs(got - ref) <= 1e-5 * scale) > 0.9
    ungated = gated_rms_norm(x.reshape(1, H, d), g, jnp.full((1, H, d), 30.0), 1e-5).reshape(1, -1)
    assert np.abs(np.asarray(G.reference(ungated.astype(jnp.bfloat16), w)) - ref).max() > 0.1 * scale
    assert np.abs(np.asarray(G.reference(x.astype(jnp.bfloat16), w)) - ref).max() > 0.1 * scale


def test_gemv_gnorm_fits():
    """What the gated-norm GEMV refuses, by name, and auto only where the step was measured with it."""
    x, z, g, w = _gnorm_case(64, 8, 32)
    assert G.gnorm_fits(x, z, g, 1e-5, w, jnp.bfloat16, only_where_faster=False) is None
    assert "one row" in G.gnorm_fits(jnp.concatenate([x, x]), z, g, 1e-5, w, jnp.bfloat16)
    assert "power-of-two d" in G.gnorm_fits(x, z, g[:-1], 1e-5, w, jnp.bfloat16)
    assert "bf16 weights" in G.gnorm_fits(x, z, g, 1e-5, w.astype(jnp.float32), jnp.bfloat16)
    assert "whole heads" in G.gnorm_fits(x, z, g, 1e-5, w, jnp.bfloat16, config=G.Config(bn=16, bk=16),
                                         only_where_faster=False)
    assert "not measured" in G.gnorm_fits(x, z, g, 1e-5, w, jnp.bfloat16)
    S = jax.ShapeDtypeStruct  # the 48B's KDA o_proj, measured in the step: auto takes it
    x48, g48, w48 = S((1, 4096), jnp.float32), S((128,), jnp.float32), S((2304, 4096), jnp.bfloat16)
    assert G.gnorm_fits(x48, x48, g48, 1e-5, w48, jnp.bfloat16) is None
    x3, z3, g3, w3 = _gnorm_case(64, 24, 128)  # 3 heads a tile: K divides, but the tile is no power of two
    assert "a power of two" in G.gnorm_fits(x3, z3, g3, 1e-5, w3, jnp.bfloat16, config=G.Config(bn=16, bk=384, splits=2),
                                            only_where_faster=False)


def test_gemv_gnorm_tiling_knobs(monkeypatch):
    """GNORM_SPLITS / GNORM_BN / GNORM_WARPS (a step A/B's patch) replace config_for's tiling of the gated-norm GEMV, 0
    keeps it; a tiling they make is checked by fits as any other, and computes the same function (interpret mode)."""
    base = G.gnorm_config(2304, 4096, 128)
    assert (base.splits, base.bn, base.num_warps) == (G.config_for(1, 2304, 4096).splits, 16, 4)
    monkeypatch.setattr(G, "GNORM_SPLITS", 8)
    monkeypatch.setattr(G, "GNORM_BN", 32)
    monkeypatch.setattr(G, "GNORM_WARPS", 8)
    c = G.gnorm_config(2304, 4096, 128)
    assert (c.splits, c.bn, c.num_warps, c.bk) == (8, 32, 8, base.bk)
    x, z, g, w = _gnorm_case(64, 16, 32)  # K 512: two tiles of 256
    monkeypatch.setattr(G, "GNORM_SPLITS", 2)
    monkeypatch.setattr(G, "GNORM_WARPS", 0)
    c = G.gnorm_config(64, 512, 32)
    assert (c.splits, c.bn, c.num_warps) == (2, 32, G.config_for(1, 64, 512).num_warps)
    assert G.gnorm_fits(x, z, g, 1e-5, w, jnp.bfloat16, only_where_faster=False) is None
    got = np.asarray(G.gemv_gnorm(x, z, g, 1e-5, w, jnp.bfloat16, interpret=True))
    ref = np.asarray(G.gnorm_reference(x, z, g, 1e-5, w, jnp.bfloat16))
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * np.abs(ref).max())
    monkeypatch.setattr(G, "GNORM_BN", 48)  # not a power of two: refused by name
    assert "tiles of bn 48" in G.gnorm_fits(x, z, g, 1e-5, w, jnp.bfloat16, only_where_faster=False)


@pytest.mark.gpu
@pytest.mark.parametrize("N,H,d", [(2304, 32, 128), (7168, 24, 128), (64, 8, 32)])
def test_gemv_gnorm_on_gpu(N, H, d):
    """Compiled at Kimi-Linear-48B's o_proj (2304 x 32 heads of 128) and K3's at TP 8 (7168 x 24 heads), against
    the reference with the bound of test_gemv_gnorm_matches_reference."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    x, z, g, w = _gnorm_case(N, H, d)
    got = np.asarray(jax.jit(lambda *a: kernels.call("gemv_gnorm", *a[:3], 1e-5, a[3], jnp.bfloat16, mode="on"))(
        x, z, g, w))
    ref = np.asarray(G.gnorm_reference(x, z, g, 1e-5, w, jnp.bfloat16))
    scale = np.abs(ref).max()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * scale)
    assert np.mean(np.abs(got - ref) <= 1e-5 * scale) > 0.9
