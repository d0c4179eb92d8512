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


# ---------------------------------------------------------------- one token in CUDA (gemv.CUDA, bf16_cuda.gemv)
class _Pallas(Exception):
    """Raised in place of a Pallas kernel's call (it lowers on a GPU only): the path a call took."""


def _no_pallas(*a, **k):
    raise _Pallas


def _custom_calls(f, *args) -> list[str]:
    """The custom-call lines of f's lowering at args."""
    return [ln for ln in jax.jit(f).lower(*args).as_text().splitlines() if "stablehlo.custom_call" in ln]


def test_gemv_cuda_lowered_and_refused(monkeypatch):
    """`gemv.CUDA` (off until timed on a GPU): where the Pallas kernel would run at one token on [N, K] weights, the
    plain and the normed GEMV lower to the CUDA kernel (on the CPU, its availability patched in), one partial sum
    [1, 1, N] (`sums`) with the norm weight and eps as attributes; an explicit Config keeps the Pallas kernel (the
    sweeps'); and the wrapper refuses what it cannot take, by name: two rows, K not a multiple of 256, float32 weights,
    a normed float32 token."""
    from jaxk3.kernels import bf16_cuda as BC

    monkeypatch.setattr(G, "CUDA", True)
    monkeypatch.setattr(BC.CU, "unavailable", lambda target=None: None)
    x, w = _xw(1, 96, 512)
    g = jnp.ones((512,), jnp.bfloat16)

    def calls(f):
        return _custom_calls(f, x, w, g)

    plain = calls(lambda x, w, g: G.gemv(x, w, sums=True))
    assert len(plain) == 1 and BC.GEMV in plain[0] and "norm = 0 : i64" in plain[0], plain
    assert "-> tensor<1x1x96xf32>" in plain[0], plain[0]
    normed = calls(lambda x, w, g: G._norm_device(x, w, g, 1e-5))
    assert len(normed) == 1 and "norm = 1 : i64" in normed[0] and "eps = 9.99999974E-6 : f32" in normed[0], normed
    monkeypatch.setattr(G, "partials", _no_pallas)
    with pytest.raises(_Pallas):
        calls(lambda x, w, g: G.gemv(x, w, config=G.Config(bn=16, bk=128)))
    monkeypatch.setattr(G, "CUDA", False)
    with pytest.raises(_Pallas):
        calls(lambda x, w, g: G.gemv(x, w))
    x2, w2 = _xw(2, 96, 512)
    assert "one row" in BC.gemv_problem(x2, w2)
    assert "multiple of 256" in BC.gemv_problem(*_xw(1, 96, 384))
    assert "bf16 weights" in BC.gemv_problem(x, w.astype(jnp.float32))
    assert "bf16 token" in BC.gemv_problem(x.astype(jnp.float32), w, g)
    assert "bf16 [K] norm weight" in BC.gemv_problem(x, w, g.astype(jnp.float32))
    with pytest.raises(ValueError, match="one row"):
        BC.gemv(x2, w2)


def test_gemv_gnorm_cuda_lowered_and_refused(monkeypatch):
    """With `gemv.CUDA`, KDA's o_proj with its gated head norm (`gemv_gnorm`, the registry's device function) lowers
    to the CUDA kernel `jaxk3_bf16_gemv_gnorm` (its availability patched in on the CPU): x, z, the float32 norm weight
    and w as operands, eps an attribute, one sum [1, 1, N]; an explicit Config keeps the Pallas kernel; and the
    wrapper refuses by name two rows, a bf16 core output, a head size not a multiple of 32, and a normed row not cast
    to bf16."""
    from jaxk3.kernels import bf16_cuda as BC

    monkeypatch.setattr(G, "CUDA", True)
    monkeypatch.setattr(BC.CU, "unavailable", lambda target=None: None)
    x, z, g, w = _gnorm_case(96, 8, 64)

    got = _custom_calls(lambda x, z, g, w: G.gemv_gnorm(x, z, g, 1e-5, w, jnp.bfloat16), x, z, g, w)
    assert len(got) == 1 and BC.GEMV_GNORM in got[0] and "eps = 9.99999974E-6 : f32" in got[0], got
    assert "tensor<1x512xf32>, tensor<1x512xf32>, tensor<64xf32>, tensor<96x512xbf16>" in got[0], got[0]
    assert "-> tensor<1x1x96xf32>" in got[0], got[0]

    import jax.experimental.pallas as pl
    monkeypatch.setattr(pl, "pallas_call", _no_pallas)
    with pytest.raises(_Pallas):
        c = G.gnorm_config(96, 512, 64)
        _custom_calls(lambda x, z, g, w: G.gemv_gnorm(x, z, g, 1e-5, w, jnp.bfloat16, config=c), x, z, g, w)
    assert "one row" in BC.gnorm_problem(jnp.concatenate([x, x]), z, g, w, jnp.bfloat16)
    assert "float32 x, z" in BC.gnorm_problem(x.astype(jnp.bfloat16), z, g, w, jnp.bfloat16)
    assert "bf16 normed row" in BC.gnorm_problem(x, z, g, w, jnp.float32)
    x5, z5, g5, w5 = _gnorm_case(64, 16, 16)  # heads of 16
    assert "multiple of 32" in BC.gnorm_problem(x5, z5, g5, w5, jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        BC.gemv_gnorm(x5, z5, g5, 1e-5, w5)


@pytest.mark.gpu
@pytest.mark.parametrize("N,H,d", [(2304, 32, 128), (7168, 24, 128), (2305, 8, 64)])
def test_gemv_gnorm_cuda_on_gpu(N, H, d, monkeypatch):
    """The CUDA o_proj with the gated head norm compiled at Kimi-Linear-48B's KDA o_proj (2304 x 32 heads of 128),
    K3's at TP 8 and an odd N of heads of 64: against the reference at `test_gemv_gnorm_matches_reference`'s bound (a
    normed element may round to the neighbouring bf16: another order of each head's squares, the device's sigmoid),
    and grids capped at 1, 3 and 131 CTAs give the same bits."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda) and the extension built with CUDA")
    from jaxk3.kernels import bf16_cuda as BC

    if BC.CU.unavailable(BC.GEMV_GNORM):
        pytest.skip(f"{BC.CU.unavailable(BC.GEMV_GNORM)} (scripts/gpu_check.sh build)")
    x, z, g, w = _gnorm_case(N, H, d)
    monkeypatch.setattr(G, "CUDA", True)
    f = jax.jit(lambda *a: G.gemv_gnorm(*a[:3], 1e-5, a[3], jnp.bfloat16))
    assert BC.GEMV_GNORM in f.lower(x, z, g, w).as_text()
    got = np.asarray(f(x, z, g, w))
    ref = np.asarray(G.gnorm_reference(x, z, g, 1e-5, w, jnp.bfloat16))
    scale = np.abs(ref).max()
    assert got.shape == ref.shape == (1, N) and np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * scale)
    assert np.mean(np.abs(got - ref) <= 1e-5 * scale) > 0.9
    for ctas in (1, 3, 131):
        capped = np.asarray(jax.jit(lambda *a: BC.gemv_gnorm(*a[:3], 1e-5, a[3], ctas=ctas))(x, z, g, w))[0]
        np.testing.assert_array_equal(capped.view(np.uint32), got.view(np.uint32), err_msg=f"ctas {ctas}")


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,norm", [(12576, 2304, True), (6720, 2304, True), (18432, 2304, True),
                                      (12577, 2304, True), (2304, 4096, False), (4608, 7168, False), (96, 512, False)])
def test_gemv_cuda_on_gpu(N, K, norm, monkeypatch):
    """The CUDA GEMV compiled at the 48B's normed input projections (KDA's fused in_proj, MLA's, the dense MLP's gate |
    up), an odd N (the last row pair reads its row twice and writes it once), plain o_proj-like and K3 shapes, and a
    tiny one: against XLA's (norm then) dot, the Pallas kernel's bounds (1e-5 of max|y| plain; 4e-3 with the norm,
    most outputs to 1e-5), rows of different scale; and grids capped at 1, 3 and 131 CTAs give the same bits."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda) and the extension built with CUDA")
    from jaxk3.kernels import bf16_cuda as BC

    if BC.CU.unavailable(BC.GEMV):
        pytest.skip(f"{BC.CU.unavailable(BC.GEMV)} (scripts/gpu_check.sh build)")
    x, w = _xw(1, N, K)
    r = np.random.default_rng(3)
    w = (w.astype(jnp.float32) * jnp.asarray(10.0 ** r.uniform(-1, 1, (N, 1)), jnp.float32)).astype(jnp.bfloat16)
    g = jnp.asarray(r.uniform(0.5, 1.5, K), jnp.bfloat16) if norm else None
    monkeypatch.setattr(G, "CUDA", True)
    f = jax.jit(lambda x, w, g: G._norm_device(x, w, g, 1e-5) if norm else G.gemv(x, w))
    text = f.lower(x, w, g).as_text()
    assert BC.GEMV in text  # the CUDA kernel, not the Pallas one
    got = np.asarray(f(x, w, g))
    ref = np.asarray(G.reference(x, w, norm_w=g, eps=1e-5))
    assert got.shape == ref.shape == (1, N) and np.isfinite(got).all()
    if norm:
        np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * np.abs(ref).max())
        assert np.mean(np.abs(got - ref) <= 1e-5 * np.abs(ref).max()) > 0.9
    else:
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    for ctas in (1, 3, 131):
        capped = np.asarray(jax.jit(lambda x, w, g: BC.gemv(x, w, g, 1e-5, ctas=ctas))(x, w, g))[0]
        np.testing.assert_array_equal(capped.view(np.uint32), got.view(np.uint32), err_msg=f"ctas {ctas}")


def _bf16_calls(BC, E=8, I=256, In=512, N=96) -> list[str]:
    """The custom-call lines of the four one-token bf16 CUDA wrappers' lowerings (the availability not needed: lowering
    names the target and its attributes only)."""
    r = np.random.default_rng(0)
    x, w = _xw(1, N, In)
    xg, zg, gg, wg = _gnorm_case(N, 8, 64)
    stack = jnp.asarray(r.standard_normal((E, 2 * I, In)) * 0.05, jnp.bfloat16)
    w2 = jnp.asarray(r.standard_normal((E, In, I)) * 0.05, jnp.bfloat16)
    ids, coef = jnp.asarray([1, 3], jnp.int32), jnp.asarray([0.5, 0.25], jnp.float32)
    a = jnp.asarray(r.standard_normal((2, 1, I)), jnp.bfloat16)
    return (_custom_calls(lambda x, w: BC.gemv(x, w), x, w)
            + _custom_calls(lambda *q: BC.gemv_gnorm(*q[:3], 1e-5, q[3]), xg, zg, gg, wg)
            + _custom_calls(lambda i, c, x, s: BC.gate_up(i, c, x[0], s, s, I, I, None, "silu", 4.0, 25.0), ids, coef,
                            x[:, :In], stack)
            + _custom_calls(lambda i, c, a, w2: BC.down(i, c, a, w2, None), ids, coef, a, w2))


def test_bf16_cuda_pdl_attribute(monkeypatch):
    """`bf16_cuda.PDL` reaches each of the four one-token bf16 CUDA calls as its `pdl` attribute (0 by default, 1 when
    set), which the handlers read to launch their kernels as programmatic dependent launches."""
    import re
    from jaxk3.kernels import bf16_cuda as BC

    assert BC.PDL is False
    for want in (0, 1):
        monkeypatch.setattr(BC, "PDL", bool(want))
        lines = _bf16_calls(BC)
        assert [re.search(r"custom_call @(\w+)", ln).group(1) for ln in lines] == [BC.GEMV, BC.GEMV_GNORM, BC.GATE_UP,
                                                                                   BC.DOWN]
        for ln in lines:
            assert re.search(rf"pdl = {want} : i64", ln), ln


def test_bf16_cuda_kernels_wait_for_their_predecessors():
    """Each one-token bf16 CUDA kernel, compiled to PTX for sm_90 (nvcc), waits for the kernels before it
    (`griddepcontrol.wait`, ffi/cuda_persistent_grid.h's WaitForPredecessors) before its first load of anything they
    write, as XLA's kernels do under programmatic dependent launch: the experts' kernels before any global load (their
    weights' addresses come from the router's choices), the GEMV after its first row pair's weight loads only (the
    weight stream's `bf16::Stream16`, `ld.global.nc.L1::no_allocate`; no kernel writes the weights).  Without the wait a
    programmatic launch could read a token not yet written; with it a plain launch is unchanged (the wait returns at
    once).  (The PTX's order, not the SASS's: ptxas keeps loads after the wait, which orders memory.)"""
    import pathlib
    import re
    import shutil
    import subprocess
    import tempfile

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc to compile ffi/cuda_bf16_*.cu to PTX")
    root = pathlib.Path(__file__).resolve().parent.parent
    entries = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("cuda_bf16_gemv", "cuda_bf16_experts"):
            ptx = pathlib.Path(tmp) / f"{name}.ptx"
            subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_90", "-ptx", f"-I{jax.ffi.include_dir()}",
                            f"-I{root / 'ffi'}", str(root / "ffi" / f"{name}.cu"), "-o", str(ptx)],
                           check=True, capture_output=True)
            for m in re.finditer(r"\.entry (\S+)\((.*?)\n\}\n", ptx.read_text(), re.S):
                entries[m.group(1)] = m.group(0)
    kinds = {"Bf16GemvKernel": 0, "Bf16GateUpKernel": 0, "Bf16DownKernel": 0}
    for entry, body in entries.items():
        kind = next(k for k in kinds if k in entry)
        kinds[kind] += 1
        assert body.count("griddepcontrol.wait") == 1, entry
        before = body[: body.index("griddepcontrol.wait")]
        if kind == "Bf16GemvKernel":
            loads = before.count("ld.global")
            assert loads >= 2 and before.count("ld.global.nc.L1::no_allocate") == loads, entry
        else:
            assert "ld.global" not in before, entry
    assert kinds == {"Bf16GemvKernel": 1, "Bf16GateUpKernel": 1, "Bf16DownKernel": 4}, kinds


@pytest.mark.gpu
@pytest.mark.parametrize("command_buffer", [False, True])
def test_bf16_cuda_pdl_same_bits_on_gpu(monkeypatch, command_buffer):
    """With `bf16_cuda.PDL` the four one-token bf16 CUDA kernels, launched as programmatic dependent launches between
    XLA's kernels that write their inputs just before them and read their outputs just after, run (the launch is
    accepted, outside XLA's command buffers and captured inside them) and give the bits of the plain launches on each
    of five runs: the 48B's KDA in_proj with its norm, its o_proj with the gated head norm, and the routed experts' two
    kernels with the shared experts and the residual add.  What it cannot show is that the wait is needed: XLA's
    kernels do not let a dependent start before their last CTA exits, so a kernel without the wait would mostly pass
    too; where the wait falls is `test_bf16_cuda_kernels_wait_for_their_predecessors`'s."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda) and the extension built with CUDA")
    from jaxk3.kernels import bf16_cuda as BC

    monkeypatch.setattr(BC, "COMMAND_BUFFER", command_buffer)  # (before the availability: it names the form's targets)
    why = BC.CU.unavailable(BC.target(BC.GEMV)) or BC.CU.unavailable(BC.target(BC.GEMV_GNORM)) or BC.unavailable()
    if why:
        pytest.skip(f"{why} (scripts/gpu_check.sh build)")
    r = np.random.default_rng(7)
    K, N, E, I, H, d = 2304, 12576, 64, 1024, 32, 128
    x = jnp.asarray(r.standard_normal((1, K)), jnp.bfloat16)
    w = jnp.asarray(r.standard_normal((N, K)) * 0.02, jnp.bfloat16)
    g = jnp.asarray(r.uniform(0.5, 1.5, K), jnp.bfloat16)
    xo, zo = (jnp.asarray(r.standard_normal((1, H * d)), jnp.float32) for _ in range(2))
    go = jnp.asarray(r.uniform(0.5, 1.5, d), jnp.float32)
    wo = jnp.asarray(r.standard_normal((K, H * d)) * 0.02, jnp.bfloat16)
    logits, bias = jnp.asarray(r.standard_normal(E), jnp.float32), jnp.asarray(0.1 * r.standard_normal(E), jnp.float32)
    w13 = jnp.asarray(r.standard_normal((E, 2 * I, K)) * 0.02, jnp.bfloat16)
    w2 = jnp.asarray(r.standard_normal((E, K, I)) * 0.02, jnp.bfloat16)
    sgu = jnp.asarray(r.standard_normal((2 * I, K)) * 0.02, jnp.bfloat16)
    sd = jnp.asarray(r.standard_normal((K, I)) * 0.02, jnp.bfloat16)

    def chain(x, w, g, xo, zo, go, wo, logits, bias, w13, w2, sgu, sd):
        xin = (x.astype(jnp.float32) * 1.5 + 0.25).astype(jnp.bfloat16)  # written just before the kernel reads it
        y = BC.gemv(xin, w, g, 1e-5)[0]
        o = BC.gemv_gnorm(xo * 2.0, zo - 0.5, go, 1e-5, wo)[0]
        h = (o * 0.5).astype(jnp.bfloat16)
        a, ids, coef = BC.gate_up(logits * 1.25, bias, h[0], w13, w13, I, I, sgu, "silu", 4.0, 25.0,
                                  route=(8, True, 2.446))
        out = BC.down(ids, coef, a, w2, sd, residual=h)
        return y.sum() + 1.0, y, o, out.astype(jnp.float32) * 3.0

    args = (x, w, g, xo, zo, go, wo, logits, bias, w13, w2, sgu, sd)
    results = {}
    for pdl in (False, True):
        monkeypatch.setattr(BC, "PDL", pdl)
        f = jax.jit(chain)
        assert f.lower(*args).as_text().count(f"pdl = {int(pdl)} : i64") == 4
        results[pdl] = [[np.asarray(v) for v in f(*args)] for _ in range(5)]
    want = results[False][0]
    for pdl, runs in results.items():
        for i, run in enumerate(runs):
            for k, (got, ref) in enumerate(zip(run, want)):
                np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32),
                                              err_msg=f"pdl {pdl} run {i} #{k}")


def test_bf16_cuda_command_buffer_form_is_named(monkeypatch):
    """Each one-token bf16 CUDA kernel has two FFI targets, the same handler with and without XLA's command-buffer
    trait: `bf16_cuda.COMMAND_BUFFER` off (the default) names the one XLA launches between its command buffers, on the
    `_cb` one inside them; both forms of all four are registered under those names by the build (ffi/targets.h)."""
    import re
    from jaxk3.kernels import bf16_cuda as BC

    monkeypatch.setattr(G, "CUDA", True)
    monkeypatch.setattr(BC.CU, "unavailable", lambda target=None: None)
    x, w = _xw(1, 96, 512)
    xg, zg, gg, wg = _gnorm_case(96, 8, 64)

    def targets() -> list[str]:
        lines = (_custom_calls(lambda x, w: G.gemv(x, w), x, w)
                 + _custom_calls(lambda *a: G.gemv_gnorm(*a[:3], 1e-5, a[3], jnp.bfloat16), xg, zg, gg, wg))
        return [re.search(r"custom_call @(\w+)", ln).group(1) for ln in lines]

    assert BC.COMMAND_BUFFER is False
    plain = targets()
    assert plain == [BC.GEMV, BC.GEMV_GNORM], plain
    monkeypatch.setattr(BC, "COMMAND_BUFFER", True)
    cb = targets()
    assert cb == [t + "_cb" for t in plain], cb
    assert [BC.target(n) for n in (BC.GATE_UP, BC.DOWN)] == ["jaxk3_bf16_gate_up_cb", "jaxk3_bf16_down_cb"]
    import pathlib
    text = (pathlib.Path(__file__).parent.parent / "ffi" / "targets.h").read_text()
    for name in (BC.GATE_UP, BC.DOWN, BC.GEMV, BC.GEMV_GNORM):
        assert f'X("{name}", jaxk3_cuda_{name[6:]})' in text and f'X("{name}_cb", jaxk3_cuda_{name[6:]}_cb)' in text, name
