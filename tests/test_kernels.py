"""The kernel registry and its kernels against their jnp reference paths.

Each device kernel runs here in Pallas interpret mode (the CPU), on random inputs (never zeros;
outputs are fresh arrays, so nothing unwritten survives), bf16 and fp32, ragged batch sizes.
Tolerance: the kernel computes the same fp32 expression as the reference; interpret mode and XLA
may fuse the mean differently, so 1e-6 relative (fp32 rounding of a 256-term sum) — a wrong
kernel (missing eps, wrong axis, no weight) is off by >= 1e-3.
"""
import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxk3 import kernels


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_rms_norm_kernel_matches_reference(dtype, B):
    rng = np.random.default_rng(B)
    x = jnp.asarray(rng.standard_normal((B, 256)) * 3, dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(256), dtype)
    k = kernels.REGISTRY["rms_norm"]
    got = np.asarray(k.device(x, w, 1e-5, interpret=True))
    ref = np.asarray(k.reference(x, w, 1e-5))
    assert got.dtype == ref.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.max(np.abs(ref)))


def test_selection_and_switch():
    x, w = jnp.ones((2, 256)), jnp.ones(256)
    assert kernels.explain("rms_norm", x, w, 1e-5, platform="gpu").startswith("device")
    assert "kernels='off'" in kernels.explain("rms_norm", x, w, 1e-5, platform="gpu", mode="off")
    assert "platform 'cpu'" in kernels.explain("rms_norm", x, w, 1e-5, platform="cpu")
    assert "power of two" in kernels.explain("rms_norm", jnp.ones((2, 2304)), jnp.ones(2304), 1e-5, platform="gpu")
    # on this CPU machine auto takes the reference, and "on" names why it cannot
    np.testing.assert_array_equal(np.asarray(kernels.call("rms_norm", x, w, 1e-5)),
                                  np.asarray(kernels.REGISTRY["rms_norm"].reference(x, w, 1e-5)))
    with pytest.raises(kernels.KernelUnavailableError, match="platform 'cpu'"):
        kernels.call("rms_norm", x, w, 1e-5, mode="on")
    with pytest.raises(ValueError, match="mode must be one of"):
        kernels.explain("rms_norm", x, w, 1e-5, mode="fast")
    assert kernels.active("gpu")["rms_norm"] and not kernels.active("cpu")["rms_norm"]
    with pytest.raises(ValueError, match="registered twice"):
        kernels.register(kernels.REGISTRY["rms_norm"])
    assert jax.devices()[0].platform == "cpu"


@pytest.mark.gpu
def test_rms_norm_kernel_on_gpu():
    """The compiled Pallas kernel (Triton) on a GPU against the reference, at a K3-like width."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() != "cpu" else []
    if not gpus:
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 4096)), jnp.bfloat16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(4096), jnp.bfloat16)
    assert kernels.explain("rms_norm", x, w, 1e-5).startswith("device")
    got = np.asarray(jax.jit(lambda x, w: kernels.call("rms_norm", x, w, 1e-5, mode="on"))(x, w))
    ref = np.asarray(kernels.REGISTRY["rms_norm"].reference(x, w, 1e-5))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))


# ------------------------------------------------------------------ moe_experts
def _moe_case(fmt: str, dtype, B: int, seed: int = 0, duplicate: bool = True, **overrides):
    """A tiny K3 MoE layer's weights (dense or MXFP4, `dtype` activations) and B routed tokens (`overrides`: the
    tiny config's fields changed)."""
    import dataclasses

    from jaxk3 import checkpoint
    from jaxk3.config import KimiK3Config
    from jaxk3.layers import moe
    from jaxk3.model import random_hf_weights

    cfg = dataclasses.replace(KimiK3Config.tiny_k3(**overrides), experts_format=fmt)
    host = checkpoint.read_all(checkpoint.build_plan(cfg, checkpoint.ArraySource(random_hf_weights(cfg, seed)), 1))
    w = jax.tree.map(lambda a: jnp.asarray(a) if a.dtype == np.uint8 else jnp.asarray(a, dtype), host.layers[1].ffn)
    w = moe.with_f16(w, moe.f16_exact(w))  # MXFP4 marked as the loader marks it (checkpoint.mark_experts_f16)
    rng = np.random.default_rng(seed + B)
    z = jnp.asarray(rng.standard_normal((B, cfg.moe_hidden)), dtype)
    wk, ids = moe.route(cfg, w.gate, w.e_score_correction_bias, jnp.asarray(rng.standard_normal((B, cfg.hidden_size)), dtype))
    if duplicate and B > 1:
        ids = ids.at[-1, 0].set(ids[0, 0])  # two tokens share an expert: read once, used twice
    return cfg, w, z, wk, ids


def _joined(w):
    """The serving layout's experts: w1 | w3 as one [E, 2I, L] stack (dense or MXFP4), as the model joins them."""
    from jaxk3 import params

    return params.serve_local(w)


def _shared(w, dtype, seed: int = 7):
    """Random shared experts of the routed experts' shapes (the kernel fuses them: Kimi-Linear's case)."""
    from jaxk3.kernels.moe_experts import SharedMLP

    E, L, I = (w.experts_w2.shape if not hasattr(w.experts_w2, "packed") else
               (*w.experts_w2.packed.shape[:2], 2 * w.experts_w2.packed.shape[2]))
    r = np.random.default_rng(seed)
    return SharedMLP(jnp.asarray(0.1 * r.standard_normal((2 * I, L)), dtype), jnp.asarray(0.1 * r.standard_normal((L, I)), dtype))


# bf16 is slow (the newest-jax suite leaves it to the first): float32 takes the same kernel paths.  The layouts:
# w1 and w3 apart, or joined (dense: with the shared experts fused, which covers the join; MXFP4: the join alone,
# and the shared experts refused).  B = 8: duplicates among the choices and padded plan slots (B = 3 pads the
# rows too: the compiled test's case).
@pytest.mark.parametrize("fmt,layout", [("dense", "checkpoint"), ("dense", "joined+shared"), ("mxfp4", "checkpoint"),
                                        ("mxfp4", "joined"), ("mxfp4", "joined+shared")])
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("B", [1, 8])
def test_moe_experts_kernel_matches_reference(fmt, dtype, B, layout):
    """Interpret mode against `experts_partial` (+ `shared_partial`): w1 and w3 apart or joined, the shared
    experts fused (dense only; MXFP4 with them is refused by `fits` and checked so).  B = 1: element-wise
    tiles; B > 1: the tensor-core dot (dense) or per-token reductions (MXFP4).  Tolerance: both sum the
    same float32 products in another order (tiles, split parts, then slots); float32 reassociation over
    <= 128 + 64 terms is ~1e-7 relative (measured 2e-7), so 2e-6 of max|ref|; a wrong scale, nibble
    order, weight, coefficient or missed duplicate is off by >= 1e-2 of it."""
    from jaxk3.kernels import moe_experts as ME

    cfg, w, z, wk, ids = _moe_case(fmt, dtype, B)
    if layout != "checkpoint":
        w = _joined(w)
    shared = _shared(w, w.experts_w2.dtype if fmt == "dense" else dtype) if layout.endswith("shared") else None
    c = ME.Config(bn=16, bk=32, splits=2)  # tiny dims (L 128, I 64): tiles in both loops, two splits of I
    if shared is not None and fmt == "mxfp4":
        assert "bf16 routed experts only" in ME.fits(cfg, w, z, wk, ids, shared=shared, config=c)
        return
    if fmt == "dense" and dtype == jnp.bfloat16 or fmt == "mxfp4":
        assert ME.fits(cfg, w, z, wk, ids, shared=shared, config=c, only_where_faster=False) is None
    got = np.asarray(ME.experts(cfg, w, z, wk, ids, shared=shared, interpret=True, config=c))
    ref = np.asarray(ME.reference(cfg, w, z, wk, ids, shared=shared))
    assert got.shape == ref.shape == (B, cfg.moe_hidden) and np.abs(ref).max() > 0
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    if shared is not None:  # the shared experts are in the sum: without them the result moves
        assert np.abs(ref - np.asarray(ME.reference(cfg, w, z, wk, ids))).max() > 1e-3 * np.abs(ref).max()
    if fmt == "dense" and B > 1:  # the weights as the MMA's M side (`swap`, the default where In <= 2304: 8 token
        # rows) and the tokens as its M side (16 rows), both run
        cs = dataclasses.replace(c, swap=False)
        assert ME._rows_padded(w, z, c) == 8 and ME._rows_padded(w, z, cs) == 16
        got = np.asarray(ME.experts(cfg, w, z, wk, ids, shared=shared, interpret=True, config=cs))
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
        # the rule: on at Kimi-Linear's 2304-wide input, off at K3's 7168 unless set
        assert ME._resolve(ME.Config(), B, 2304, 1024, 2304).swap
        assert not ME._resolve(ME.Config(), B, 7168, 1536, 3584).swap
        assert ME._resolve(ME.Config(swap=True), B, 7168, 1536, 3584).swap
        assert not ME._resolve(ME.Config(), 1, 2304, 1024, 2304).swap


def _routed_case(fmt: str, dtype, E: int | None = None, ties: bool = True, seed: int = 3, B: int = 1):
    """`_moe_case` with the experts cut to E (a count not a power of two pads the logits), B tokens' random router
    logits and a bias, and (ties) k - 1 clear leaders and two experts tied for the k-th place for every token (so
    lax.top_k's rule, the lower index first, decides which one is read, and at B > 1 the tokens share experts)."""
    cfg, w, z, _, _ = _moe_case(fmt, dtype, B, seed=seed)
    if E is not None:
        from jaxk3.kernels import moe_experts as ME

        def cut(a):
            return None if a is None else ME.MXFP4(a.packed[:E], a.scale[:E]) if isinstance(a, ME.MXFP4) else a[:E]
        w = dataclasses.replace(w, experts_w1=cut(w.experts_w1), experts_w2=cut(w.experts_w2), experts_w3=cut(w.experts_w3))
    E = w.experts_w2.shape[0] if not hasattr(w.experts_w2, "packed") else w.experts_w2.packed.shape[0]
    r = np.random.default_rng(seed)
    logits = r.standard_normal((B, E)).astype(np.float32)
    bias = (0.1 * r.standard_normal(E)).astype(np.float32)
    if ties:  # experts 1 and 4 tie for the k-th place behind k - 1 clear leaders: lax.top_k keeps 1, drops 4
        k = cfg.num_experts_per_token
        lead = [e for e in range(E) if e not in (1, 4)][:k - 1]
        logits[:, lead], bias[lead] = 8.0, 0.5
        logits[:, [1, 4]], bias[[1, 4]] = 6.0, 0.5
    return cfg, w, z, jnp.asarray(logits), jnp.asarray(bias)


@pytest.mark.parametrize("fmt,layout,E,B,route", [
    ("dense", "joined+shared", None, 1, {}), ("dense", "checkpoint", 12, 1, dict(routed_scaling_factor=2.5)),
    ("mxfp4", "joined", None, 1, dict(moe_renormalize=False)),
    ("dense", "checkpoint", 12, 1, dict(routed_scaling_factor=2.5, moe_renormalize=False))])
def test_moe_experts_routed_matches_reference(fmt, layout, E, B, route):
    """The routed form (the router's selection inside the two kernels) in interpret mode against `select_experts`
    then `experts_partial`: the same experts in the same slot order, ties included (so the same float32 sums), and
    weights from the same float32 arithmetic but for the renormalising sum's order; the bound is
    `test_moe_experts_kernel_matches_reference`'s (2e-6 of max|ref|).  One slot given another expert moves the
    result by over 100 times the bound (checked below)."""
    from jaxk3.kernels import moe_experts as ME
    from jaxk3.kernels.router import select_experts

    cfg, w, z, logits, bias = _routed_case(fmt, jnp.float32, E, B=B)
    cfg = dataclasses.replace(cfg, **route)  # the scale and the renormalisation as the router applies them
    if layout != "checkpoint":
        w = _joined(w)
    shared = _shared(w, w.experts_w2.dtype) if layout.endswith("shared") else None
    c = ME.Config(bn=16, bk=32, splits=2)
    if fmt == "mxfp4":  # (dense float32 experts: the kernel streams bf16 only; interpret mode runs them alike)
        assert ME.routed_fits(cfg, w, z, logits, bias, shared=shared, config=c, only_where_faster=False) is None
    wk, ids = select_experts(cfg, logits, bias)
    assert all(1 in row and 4 not in row for row in np.asarray(ids).tolist())  # the tie broken as lax.top_k does
    got = np.asarray(ME.experts_routed(cfg, w, z, logits, bias, shared=shared, interpret=True, config=c))
    ref = np.asarray(ME.routed_reference(cfg, w, z, logits, bias, shared=shared))
    assert got.shape == ref.shape == (B, cfg.moe_hidden) and np.abs(ref).max() > 0
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    # the kernel's own path with the ids and weights given agrees with it, and a wrong expert does not
    via_ids = np.asarray(ME.experts(cfg, w, z, wk, ids, shared=shared, interpret=True, config=c))
    np.testing.assert_allclose(got, via_ids, rtol=0, atol=2e-6 * np.abs(ref).max())
    other = next(e for e in range(logits.shape[1]) if e not in set(np.asarray(ids[0]).tolist()))
    wrong = np.asarray(ME.reference(cfg, w, z, wk, ids.at[0, -1].set(other), shared=shared))
    assert np.abs(wrong - ref).max() > 100 * 2e-6 * np.abs(ref).max()  # one slot's expert wrong: far outside


def test_moe_experts_routed_fits(monkeypatch):
    """What the routed form refuses, by name: grouped top-k, logits of another shape, too many experts to rank
    in registers, more than one token (its B > 1 forms were measured slower and removed); and `auto` only where
    the step was measured."""
    from jaxk3.kernels import moe_experts as ME

    cfg, w, z, logits, bias = _routed_case("dense", jnp.bfloat16, ties=False)
    w = _joined(w)
    grouped = dataclasses.replace(cfg, use_grouped_topk=True, num_expert_group=2)
    assert "group-limited" in ME.routed_fits(grouped, w, z, logits, bias, only_where_faster=False)
    assert "logits [1," in ME.routed_fits(cfg, w, z, logits[:, :-1], bias, only_where_faster=False)
    assert "logits [2," in ME.routed_fits(cfg, w, jnp.concatenate([z, z]), logits, bias, only_where_faster=False)
    assert ME.routed_fits(cfg, w, z, logits, bias, only_where_faster=False) is None
    z2, l2 = jnp.concatenate([z, z]), jnp.concatenate([logits, logits])
    assert "takes one token" in ME.routed_fits(cfg, w, z2, l2, bias, only_where_faster=False)
    with pytest.raises(ValueError, match="takes one token"):
        ME.experts_routed(cfg, w, z2, l2, bias, interpret=True)
    assert "not measured" in ME.routed_fits(cfg, w, z, logits, bias)
    monkeypatch.setattr(ME, "MAX_ROUTED_EXPERTS", logits.shape[1] - 1)
    assert "k <= E <=" in ME.routed_fits(cfg, w, z, logits, bias, only_where_faster=False)


def _routed_real(E: int, seed: int = 5, B: int = 1):
    """Kimi-Linear-48B's MoE block at TP 1 in the serving layout with E experts kept (bf16, w1 | w3 joined, the
    shared experts fused), B tokens, random logits with two tied at the top of every token's: the step's call."""
    from jaxk3.kernels.moe_experts import SharedMLP
    from jaxk3.layers import moe
    from jaxk3.tools.bench_decode import load_config

    cfg = dataclasses.replace(load_config("kimi-linear-48b"), num_experts=E)
    I, L = cfg.moe_intermediate_size, cfg.hidden_size
    keys = iter(jax.random.split(jax.random.key(seed), 8))

    def a(*shape, s=0.02):
        return (jax.random.normal(next(keys), shape, jnp.float32) * s).astype(jnp.bfloat16)
    w = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=None, experts_w3=None,
                       experts_w2=a(E, L, I), experts_w13=a(E, 2 * I, L))
    r = np.random.default_rng(seed)
    logits = r.standard_normal((B, E)).astype(np.float32)
    bias = (0.1 * r.standard_normal(E)).astype(np.float32)
    logits[:, [3, E - 2]], bias[[3, E - 2]] = 6.0, 0.5
    return cfg, w, a(B, L, s=1.0), jnp.asarray(logits), jnp.asarray(bias), SharedMLP(a(2 * I, L), a(L, I))


@pytest.mark.gpu
@pytest.mark.parametrize("E,B", [(64, 1), (256, 1)])
def test_moe_experts_routed_on_gpu(E, B):
    """Compiled at Kimi-Linear-48B's dims (64 experts as the bench keeps, and all 256; one token) against `select_experts` + `experts_partial` in XLA: 4e-3 of
    max|ref| as tests/test_kernels_real.py argues for moe_experts (the bf16 intermediate rounded from fp32 sums
    in another order); and against the same kernels given the ids and weights (the same sums in the same order,
    the weights but for the renormalising sum's order): 1e-5."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    cfg, w, z, logits, bias, shared = _routed_real(E, B=B)
    assert kernels.explain("moe_experts_routed", cfg, w, z, logits, bias, shared=shared, mode="on").startswith("device")
    got = np.asarray(jax.jit(lambda *a: kernels.call("moe_experts_routed", cfg, *a, shared=shared, mode="on"))(
        w, z, logits, bias))
    ref = np.asarray(jax.jit(lambda *a: kernels.REGISTRY["moe_experts_routed"].reference(cfg, *a, shared=shared))(
        w, z, logits, bias))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * np.abs(ref).max())
    from jaxk3.kernels.router import select_experts

    wk, ids = select_experts(cfg, logits, bias)
    same = np.asarray(jax.jit(lambda *a: kernels.call("moe_experts", cfg, *a, shared=shared, mode="on"))(w, z, wk, ids))
    np.testing.assert_allclose(got, same, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_moe_experts_bits_decode_is_the_select_decode_bit_for_bit():
    """The "bits" E2M1 decode (the scaled float built from its bits) and the "f16" one (float16's bits) against the
    select-and-multiply one, every code (0..15) at every E8M0 scale (0..255), bitwise; then the kernel with each in
    interpret mode."""
    from jaxk3.kernels import moe_experts as ME

    code = jnp.arange(16, dtype=jnp.int32)[:, None]
    s = jnp.arange(256, dtype=jnp.int32)[None, :]
    want = np.asarray(ME._e2m1(code) * ME.e8m0_scales(s.astype(jnp.uint8)))
    got = np.asarray(ME._e2m1_scaled_bits(code, s))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    scale = ME.e8m0_scales(s.astype(jnp.uint8))  # the "f16" decode: float16's bits, times 2^14, times the scale
    got = np.asarray(ME._e2m1_f16(code) * jnp.float32(2.0 ** 14) * scale)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, 1)
    c = ME.Config(bn=32, bk=64, decode="bits")
    assert ME.fits(cfg, w, z, wk, ids, config=c, only_where_faster=False) is None
    got = np.asarray(ME.experts(cfg, w, z, wk, ids, interpret=True, config=c))
    ref = np.asarray(ME.experts_partial(cfg, w, z, wk, ids))
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())  # as the default's test
    for c in (ME.Config(bn=32, bk=64, decode="f16"), ME.Config(decode="select"), ME.Config()):  # Config(): auto tiles
        got = np.asarray(ME.experts(cfg, w, z, wk, ids, interpret=True, config=c))
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    assert "powers of two" in ME.fits(cfg, w, z, wk, ids, config=ME.Config(bn=24))
    assert "decode must be" in ME.fits(cfg, w, z, wk, ids, config=ME.Config(decode="magic"))  # removed: slower
    assert "scale must be" in ME.fits(cfg, w, z, wk, ids, config=ME.Config(decode="bits", scale="group"))
    assert "scale must be" in ME.fits(cfg, w, z, wk, ids, config=ME.Config(scale="row"))
    assert "not measured against XLA" in ME.fits(cfg, w, z, wk, ids, config=c)


def _run_ptx(asm: str, w: np.ndarray, inputs: dict | None = None, outs: int = 4) -> list[np.ndarray]:
    """The "asm" decodes' PTX evaluated on uint32 words w (one per instance; `inputs`: the operand registers instead,
    e.g. {"$2": codes, "$3": scale pairs}) by a reading of the instructions they use (shl, shr, and, or, mov .b32;
    mov.b32 {h0, h1} splitting a word into its low and high halves; cvt.f32.f16; prmt.b32 in its default mode;
    mul.rn.f16x2, each half's exact product rounded once): the outputs $0.. ($0..$outs-1) as they are."""
    regs: dict[str, np.ndarray] = {k: v.astype(np.uint32) for k, v in (inputs or {"$4": w}).items()}
    body = asm.strip()[1:-1]
    for ins in (i.strip() for i in body.split(";") if i.strip()):
        op, _, rest = ins.partition(" ")
        args = [a.strip() for a in rest.replace("{", "").replace("}", "").split(",")]
        if op == ".reg":
            continue
        val = (lambda a: regs[a] if a in regs else np.uint32(int(a, 0)))
        if op == "mov.b32" and "{" in rest:  # split a word: {lo, hi}, word
            word = val(args[2])
            regs[args[0]], regs[args[1]] = (word & 0xFFFF).astype(np.uint16), (word >> 16).astype(np.uint16)
        elif op == "mov.b32":
            regs[args[0]] = val(args[1])
        elif op in ("shl.b32", "shr.b32", "and.b32", "or.b32"):
            a, b = val(args[1]), val(args[2])
            r = {"shl.b32": lambda: a << b, "shr.b32": lambda: a >> b, "and.b32": lambda: a & b,
                 "or.b32": lambda: a | b}[op]()
            regs[args[0]] = np.asarray(r, np.uint64).astype(np.uint32)
        elif op == "cvt.f32.f16":
            regs[args[0]] = regs[args[1]].view(np.float16).astype(np.float32)
        elif op == "prmt.b32":  # result byte i = byte sel_i (0-7) of {b, a}; sel bit 3 replicates that byte's sign
            a, b, c = (np.broadcast_to(val(x), w.shape).astype(np.uint64) for x in args[1:4])
            src, r = a | (b << 32), np.zeros(w.shape, np.uint64)
            for i in range(4):
                sel = (c >> (4 * i)) & 15
                byte = (src >> (8 * (sel & 7))) & 0xFF
                byte = np.where(sel & 8, np.where(byte & 0x80, 0xFF, 0), byte).astype(np.uint64)
                r |= byte << np.uint64(8 * i)
            regs[args[0]] = r.astype(np.uint32)
        elif op == "mul.rn.f16x2":
            a, b = (np.broadcast_to(val(x), w.shape).astype(np.uint32) for x in args[1:3])
            halves = [(x & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64) for x in (a, b)]
            lo = (halves[0] * halves[1]).astype(np.float16).view(np.uint16).astype(np.uint32)
            halves = [(x >> 16).astype(np.uint16).view(np.float16).astype(np.float64) for x in (a, b)]
            hi = (halves[0] * halves[1]).astype(np.float16).view(np.uint16).astype(np.uint32)
            regs[args[0]] = lo | (hi << 16)
        else:
            raise AssertionError(f"the test does not read {op!r}: extend it with the asm")
    return [regs[f"${i}"] for i in range(outs)]


def test_moe_experts_asm_decode_is_the_f16_decode_bit_for_bit():
    """The "asm" decode's PTX (`_ASM_LO`, `_ASM_HI`), read instruction by instruction, gives `_e2m1_f16`'s values bit
    for bit for every byte value in every one of the four byte positions of a word (and random words); in interpret
    mode the kernel runs the "f16" decode in its place (the same values), and `fits` takes it where "f16" goes."""
    from jaxk3.kernels import moe_experts as ME

    rng = np.random.default_rng(0)
    b = np.arange(256, dtype=np.uint32)
    words = np.concatenate([b, b << 8, b << 16, b << 24, rng.integers(0, 2 ** 32, 4096, dtype=np.uint64)
                            .astype(np.uint32)])
    lo, hi = _run_ptx(ME._ASM_LO, words), _run_ptx(ME._ASM_HI, words)
    for i in range(4):
        byte = jnp.asarray(((words >> (8 * i)) & 0xFF).astype(np.int32))
        for got, code in ((lo[i], byte & 15), (hi[i], byte >> 4)):
            want = np.asarray(ME._e2m1_f16(code))
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"byte {i}")
    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, 1)
    for B in (1, 3):
        z_, wk_, ids_ = (z, wk, ids) if B == 1 else _moe_case("mxfp4", jnp.bfloat16, B)[2:]
        for c in (dict(), dict(scale="weight"), dict(mx_dot=True)):
            if B == 1 and c.get("mx_dot"):
                continue
            asm, f16 = (ME.Config(bn=16, bk=64, decode=d, **c) for d in ("asm", "f16"))
            assert ME.fits(cfg, w, z_, wk_, ids_, config=asm, only_where_faster=False) is None
            np.testing.assert_array_equal(np.asarray(ME.experts(cfg, w, z_, wk_, ids_, interpret=True, config=asm)),
                                          np.asarray(ME.experts(cfg, w, z_, wk_, ids_, interpret=True, config=f16)))


def test_moe_experts_f16_asm_decode_is_the_jnp_form_bit_for_bit():
    """The float16 form's PTX (`_ASM16_LO`, `_ASM16_HI`: the codes' float16 bits after a byte permute, times the
    group's float16 2^(s − 113) by mul.rn.f16x2), read instruction by instruction, gives the jnp form's values (the
    interpret path: `_e2m1_f16`'s raw values times the scale, rounded once to float16) bit for bit: every byte value
    in each of the four positions of a word and random words, at every scale byte of F16_SCALES, each element with its
    own scale (the two pairs of a word may be two rows'), each result register holding elements 2j, 2j + 1 in its halves
    (Triton's pack=4 order); every value is code · 2^(s − 127) exactly."""
    from jaxk3.kernels import moe_experts as ME

    rng = np.random.default_rng(1)
    b = np.arange(256, dtype=np.uint32)
    words = np.concatenate([b, b << 8, b << 16, b << 24, rng.integers(0, 2 ** 32, 1024, dtype=np.uint64)
                            .astype(np.uint32)])
    table = np.asarray(ME._E2M1_VALUES, np.float64)
    lo_s, hi_s = ME.F16_SCALES
    # each element its own scale byte (Triton may pack two rows' pairs into one word: `Config.swap`): every scale of
    # F16_SCALES at element 0 in turn, the other three drawn at random
    for s in range(lo_s, hi_s + 1):
        sc = rng.integers(lo_s, hi_s + 1, (words.size, 4)).astype(np.uint8)
        sc[:, 0] = s
        s16 = np.asarray(ME._f16_scale(jnp.asarray(sc)))  # [n, 4] float16
        h = s16.view(np.uint16).astype(np.uint32)
        ins = {"$2": words, "$3": h[:, 0] | (h[:, 1] << 16), "$4": h[:, 2] | (h[:, 3] << 16)}
        got = {n: _run_ptx(asm, words, ins, outs=2) for n, asm in (("lo", ME._ASM16_LO), ("hi", ME._ASM16_HI))}
        codes = jnp.asarray(np.stack([(words >> (8 * i)) & 0xFF for i in range(4)], -1).astype(np.uint8))  # [n, 4]
        want = ME._e2m1_f16_scaled(ME._Spec(Bp=16, packed=True, bn=16, bk=64, decode="f16"), codes, jnp.asarray(s16))
        for n, wv, nib in (("lo", want[0], codes & 15), ("hi", want[1], codes >> 4)):
            bits = np.asarray(wv).view(np.uint16).astype(np.uint32)  # [n, 4]
            for j in range(2):
                np.testing.assert_array_equal(got[n][j], bits[:, 2 * j] | (bits[:, 2 * j + 1] << 16),
                                              err_msg=f"{n} register {j}, scale {s}")
            exact = table[np.asarray(nib)] * 2.0 ** (sc.astype(np.float64) - 127)
            np.testing.assert_array_equal(np.asarray(wv).astype(np.float64), exact)


def test_moe_experts_plan_reads_each_expert_once():
    from jaxk3.kernels.moe_experts import plan

    ids = jnp.array([[3, 1, 4], [1, 5, 9], [2, 6, 5]], jnp.int32)
    w = jnp.asarray(np.random.default_rng(0).uniform(0.1, 1, (3, 3)), jnp.float32)
    uniq, coef = plan(ids, w, 16)
    u = np.asarray(uniq)
    assert list(u[u >= 0]) == [1, 2, 3, 4, 5, 6, 9] and len(u) == 9 and np.all(u[7:] == -1)
    np.testing.assert_allclose(np.asarray(coef).sum(0), np.asarray(w).sum(1), rtol=1e-6)  # every choice counted once
    assert float(coef[list(u).index(5), 1]) == pytest.approx(float(w[1, 1]))
    assert float(coef[list(u).index(5), 0]) == 0.0
    uniq, _ = plan(ids, w, 4)  # fewer experts than choices: U = E
    assert uniq.shape == (4,)


def test_moe_experts_selection():
    import dataclasses

    from jaxk3.kernels.moe_experts import SharedMLP
    from jaxk3.layers import moe

    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, 2)
    # proven, but auto takes it only at the shapes where it beat XLA on the H200; "on" wherever it fits
    assert "not measured against XLA" in kernels.explain("moe_experts", cfg, w, z, wk, ids, platform="gpu")
    assert kernels.explain("moe_experts", cfg, w, z, wk, ids, platform="gpu", mode="on").startswith("device")
    assert kernels.active("gpu")["moe_experts"]
    s = jax.ShapeDtypeStruct  # the presets' per-rank shapes (fits reads shapes and dtypes only)
    bf = jnp.bfloat16
    kl = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=None, experts_w3=None,
                        experts_w2=s((64, 2304, 1024), bf), experts_w13=s((64, 2048, 2304), bf))
    shared = SharedMLP(s((2048, 2304), bf), s((2304, 1024), bf))
    for B in (1, 8):  # Kimi-Linear-48B in the serving layout with its shared experts: taken
        zz, wkk, idd = s((B, 2304), bf), s((B, 8), jnp.float32), s((B, 8), jnp.int32)
        assert kernels.explain("moe_experts", cfg, kl, zz, wkk, idd, shared=shared, platform="gpu") == "device: moe_experts on gpu"
        assert "not measured" in kernels.explain("moe_experts", cfg, kl, zz, wkk, idd, platform="gpu")  # no shared
    # all 256 experts: B = 1 reads the same k experts (taken); B = 8's choices coincide less than at the 64 measured
    kl256 = dataclasses.replace(kl, experts_w2=s((256, 2304, 1024), bf), experts_w13=s((256, 2048, 2304), bf))
    for B, want in ((1, "device: moe_experts on gpu"), (8, "not measured")):
        zz, wkk, idd = s((B, 2304), bf), s((B, 8), jnp.float32), s((B, 8), jnp.int32)
        assert want in kernels.explain("moe_experts", cfg, kl256, zz, wkk, idd, shared=shared, platform="gpu")
    k3 = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=s((64, 1536, 3584), bf),
                        experts_w3=s((64, 1536, 3584), bf), experts_w2=s((64, 3584, 1536), bf))
    one = (s((1, 3584), bf), s((1, 16), jnp.float32), s((1, 16), jnp.int32))
    assert "XLA is as fast" in kernels.explain("moe_experts", cfg, k3, *one, platform="gpu")  # K3 TP 2, B = 1
    eight = (s((8, 3584), bf), s((8, 16), jnp.float32), s((8, 16), jnp.int32))
    assert kernels.explain("moe_experts", cfg, k3, *eight, platform="gpu").startswith("device")
    assert "platform 'cpu'" in kernels.explain("moe_experts", cfg, w, z, wk, ids, platform="cpu")
    big = jnp.zeros((9, z.shape[1]), z.dtype)
    assert "1 to 8 tokens" in kernels.explain("moe_experts", cfg, w, big, wk, ids, platform="gpu", mode="on")
    wf = _moe_case("dense", jnp.float32, 2)[1]
    assert "bf16 or MXFP4 experts, got float32" in kernels.explain("moe_experts", cfg, wf, z, wk, ids, platform="gpu",
                                                                    mode="on")
    # kernels="on" in the layer: rows past MAX_B and float32 experts keep XLA's path (as linear does), no error;
    # what the kernel takes and cannot run here (the CPU) still raises
    for ww, zz in ((w, jnp.zeros((9, z.shape[1]), z.dtype)), (wf, z)):
        n = zz.shape[0]
        out = moe._experts_decode(cfg, ww, zz, jnp.full((n, wk.shape[1]), 0.25), jnp.zeros((n, ids.shape[1]), jnp.int32),
                                  "on")
        assert out.shape == (n, cfg.moe_hidden)
    with pytest.raises(kernels.KernelUnavailableError, match="platform 'cpu'"):
        moe._experts_decode(cfg, w, z, wk, ids, "on")


def test_model_kernels_option():
    """kernels='on' on the CPU names why the MoE kernel cannot run; 'off' and 'auto' decode the same."""
    import jaxk3
    from jaxk3.config import KimiK3Config

    cfg = KimiK3Config.tiny_k3()
    with pytest.raises(ValueError, match="kernels: must be one of"):
        jaxk3.init_random_model(cfg, tp=1, kernels="fast")
    on = jaxk3.init_random_model(cfg, tp=1, kernels="on")
    with pytest.raises(kernels.KernelUnavailableError, match=r"kernels='on' but \w+ does not apply: no \w+ "
                                                             r"kernel for platform 'cpu'"):
        on.generate([[1, 2, 3]], 2)
    a = jaxk3.init_random_model(cfg, tp=1, kernels="off").generate([[1, 2, 3]], 3, return_logits=True)
    b = jaxk3.init_random_model(cfg, tp=1).generate([[1, 2, 3]], 3, return_logits=True)
    np.testing.assert_array_equal(a.logits, b.logits)


def _on_cpu(monkeypatch, name: str, arg: int) -> list:
    """Register kernel `name` for the CPU in interpret mode, taken by auto wherever it fits (the tiny dims were never
    timed); the list it returns collects the shape of argument `arg` of every call."""
    from jaxk3.kernels import registry

    calls = []
    k = kernels.REGISTRY[name]

    def dev(*a, **kw):
        calls.append(a[arg].shape)
        return k.device(*a, interpret=True, **kw)

    def anywhere(*a, **kw):
        return k.fits(*a, **registry._on_runs_anywhere(k, "on", kw))
    monkeypatch.setitem(kernels.REGISTRY, name,
                        dataclasses.replace(k, platforms=("cpu",), device=dev, fits=anywhere, unproven=None))
    return calls


def _off_and_auto(cfg, prompt, calls: list, tp: int = 1, layout: str = "serving"):
    """The tiny model's prompt and 3 decode steps with kernels='off' (no patched kernel may run) and 'auto': both
    logits [B, 4, V] as float32; the prefill's (position 0) must agree exactly (no decode kernel runs there)."""
    import jaxk3

    off = jaxk3.init_random_model(cfg, tp=tp, kernels="off", layout=layout).generate(prompt, 3, return_logits=True)
    assert not calls
    auto = jaxk3.init_random_model(cfg, tp=tp, layout=layout).generate(prompt, 3, return_logits=True)
    a, b = np.asarray(off.logits, np.float32), np.asarray(auto.logits, np.float32)
    np.testing.assert_array_equal(a[:, 0], b[:, 0])
    return a, b


# slow: interpret-mode kernels inside a model; with the newest jax each kernel's own interpret test takes its paths
# (test_gemv_norm_prologue_matches_reference, test_router_topk_kernel_matches_reference,
# test_kda_decode_in_kernel_matches_reference) and test_serving the model's
@pytest.mark.slow
def test_decode_norms_in_the_kernels_prologues(monkeypatch, fresh_steps):
    """The Kimi-Linear decode step hands each block its input un-normed (layers.common.Normed). With
    `gemv_norm`, `router_topk`, `kda_decode_in` (the KDA core reading in_proj's output) and `gemv_gnorm` (o_proj
    norming the core's output) running, in
    interpret mode and registered for the CPU, the blocks' first GEMVs and the router norm it, and the logits agree with kernels='off' (XLA's norm, then
    the same products) to 2e-3 of max|logit|: here they agree exactly, and the bound leaves room for a
    bf16 rounding of a normed element moved by the order of the sum of squares; a prologue GEMV off by
    1% fails it (checked by mutation).  Each kernel must have been traced (auto takes each wherever it fits
    here: the tiny dims were never timed)."""
    from small_models import tiny_kimi_linear_4l

    from jaxk3.kernels import router

    from jaxk3.layers import moe as moe_lib

    names = {"gemv_norm": 0, "router_topk": 1, "kda_decode_in": 1, "gemv_gnorm": 0}  # kernel -> an array argument
    calls = {name: _on_cpu(monkeypatch, name, arg) for name, arg in names.items()}
    monkeypatch.setattr(router, "NORMED_PROVEN", True)
    cfg = tiny_kimi_linear_4l()  # KDA (0-2), MLA (3), the dense MLP (0), MoE (1-3)
    a, b = _off_and_auto(cfg, [[5, 6, 7, 8]], [c for name in names for c in calls[name]])
    n = {name: len(c) for name, c in calls.items()}
    # every decode block: KDA / MLA in_proj, the dense MLP's gate|up, each MoE's router (+ shared gate|up)
    moe = sum(f == "moe" for f in cfg.layer_ffn)
    assert n["gemv_norm"] >= cfg.num_hidden_layers * 2 and n["router_topk"] >= moe >= 1, n
    assert n["kda_decode_in"] == len(cfg.kda_layers), n  # the KDA core reading in_proj's output
    assert n["gemv_gnorm"] == len(cfg.kda_layers), n  # and o_proj norming its output
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3 * np.abs(a).max())


@pytest.mark.slow  # interpret-mode kernels inside a model (the kernel's own test is in both suites)
def test_decode_norms_the_latent_in_the_up_projection(monkeypatch, fresh_steps):
    """A K3 decode step (latent MoE, one rank) with moe.LATENT_NORM_IN_UP (on by default) and `gemv_norm` running
    (interpret mode, registered for the CPU): each MoE block's up projection takes the experts' fp32 latent row
    un-normed and norms it in its prologue (traced once per MoE block and decode step, on [1, L]); the logits agree
    with kernels='off' to 2e-3 of max|logit| (test_decode_norms_in_the_kernels_prologues' bound: the prologue's sum
    of squares in another order moves a normed element by a bf16 ulp at most).  Two rows keep XLA's path (the form
    was slower at B = 8 on the GPU), as does kernels='off'."""
    from small_models import tiny_k3_4l

    from jaxk3.layers import moe as moe_lib

    calls = _on_cpu(monkeypatch, "gemv_norm", 0)
    monkeypatch.setattr(moe_lib, "LATENT_NORM_IN_UP", True)
    cfg = tiny_k3_4l()
    assert cfg.latent_moe_use_norm and cfg.routed_expert_hidden_size
    a, b = _off_and_auto(cfg, [[5, 6, 7, 8]], calls, layout="checkpoint")
    moe = sum(f == "moe" for f in cfg.layer_ffn)
    assert moe >= 1 and len(calls) >= moe and set(calls) == {(1, cfg.routed_expert_hidden_size)}, calls
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3 * np.abs(a).max())
    # the form's own conditions, at the block's function: one row in a mode other than "off"
    L, D = cfg.routed_expert_hidden_size, cfg.hidden_size
    w = types.SimpleNamespace(routed_expert_up_proj=jnp.ones((D, L), jnp.bfloat16),
                              routed_expert_norm=jnp.ones((L,), jnp.bfloat16))
    y1, y2 = jnp.ones((1, L), jnp.float32), jnp.ones((2, L), jnp.float32)
    assert moe_lib._up_normed(cfg, w, y1, "auto").shape == (1, D)
    assert moe_lib._up_normed(cfg, w, y2, "auto") is None and moe_lib._up_normed(cfg, w, y2, "on") is None
    assert moe_lib._up_normed(cfg, w, y1, "off") is None


@pytest.mark.slow  # interpret-mode kernels inside a model (the kernel's own test is in both suites)
@pytest.mark.parametrize("prompt", [[[5, 6, 7, 8]], [[5, 6, 7, 8], [9, 3, 2]]])
def test_decode_routes_in_the_experts_kernels(monkeypatch, fresh_steps, prompt):
    """A Kimi-Linear decode step (B = 1) with `moe_experts_routed` running (interpret mode, registered for the
    CPU): each MoE block's selection happens in the experts' kernels, and the logits agree with kernels='off'
    (XLA's selection, then the experts' GEMVs) to 2e-3 of max|logit| (test_decode_norms_in_the_kernels_prologues'
    bound: the experts' sums in another order); the routed form must have been traced once per MoE block
    and decode step, and never at the prefill (many tokens: the grouped path).  Two ragged rows: the routed form
    refuses them (one token only) and the layer falls back to XLA's selection, the logits as close."""
    from small_models import tiny_kimi_linear_4l

    calls = _on_cpu(monkeypatch, "moe_experts_routed", 2)
    cfg = tiny_kimi_linear_4l()
    a, b = _off_and_auto(cfg, prompt, calls)
    moe = sum(f == "moe" for f in cfg.layer_ffn)
    if len(prompt) == 1:
        assert moe >= 1 and len(calls) >= moe and all(c == (1, cfg.hidden_size) for c in calls), calls
    else:
        assert not calls
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3 * np.abs(a).max())


@pytest.mark.slow  # interpret-mode kernels inside a model (the kernel's own test is in both suites)
def test_decode_merges_mla_parts_with_w_uv(monkeypatch, fresh_steps):
    """A Kimi-Linear decode step whose MLA layer takes `mla_decode_uv` (the attention's parts merged and W_UV
    applied in one kernel; interpret mode, registered for the CPU; latent and rope dims the kernel's tiles take):
    traced once per decode step, and the logits agree with kernels='off' to 2e-3 of max|logit| (measured 1.3e-4:
    the attention's bf16 operands move the MLA output by up to MLA_TOL of itself, a small part of the residual)."""
    from small_models import tiny_kimi_linear_4l

    calls = _on_cpu(monkeypatch, "mla_decode_uv", 0)
    cfg = tiny_kimi_linear_4l(kv_lora_rank=64, qk_rope_head_dim=16)
    a, b = _off_and_auto(cfg, [[5, 6, 7, 8]], calls)
    assert len(calls) >= len(cfg.mla_layers) >= 1, calls
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3 * np.abs(a).max())


@pytest.mark.slow  # interpret-mode kernels inside a model (the kernel's own test is in both suites)
@pytest.mark.parametrize("prompt", [[[5, 6, 7, 8]], [[5, 6, 7, 8], [9, 3, 2]]])
def test_decode_preps_mla_in_one_kernel(monkeypatch, fresh_steps, prompt):
    """A Kimi-Linear decode step whose MLA layer takes `mla_prep` (the absorbed query, q_pe and the new latent written
    into the cache, read from in_proj's output in place) with the attention kernels (interpret mode, registered for
    the CPU): traced once per decode step, and the logits agree with kernels='off' to 2e-3 of max|logit| (the bound
    of test_decode_merges_mla_parts_with_w_uv: the attention's bf16 operands); two ragged rows (a pad row's slot
    kept) as close."""
    from small_models import tiny_kimi_linear_4l

    calls = _on_cpu(monkeypatch, "mla_prep", 0)
    _on_cpu(monkeypatch, "mla_decode_uv", 0)
    cfg = tiny_kimi_linear_4l(kv_lora_rank=64, qk_rope_head_dim=16)
    a, b = _off_and_auto(cfg, prompt, calls)
    assert len(calls) >= len(cfg.mla_layers) >= 1 and all(c[0] == len(prompt) for c in calls), calls
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3 * np.abs(a).max())


@pytest.mark.slow  # interpret-mode kernels inside a model (the kernel's own test is in both suites)
@pytest.mark.parametrize("which,tp,layout", [("k3", 1, "serving"), ("k3", 2, "serving"),
                                             ("kimi_linear", 2, "serving"), ("kimi_linear", 1, "checkpoint")])
def test_decode_preps_mla_on_every_source(monkeypatch, fresh_steps, which, tp, layout):
    """`mla_prep` in K3's layer (q_a's norm, then q_b_proj; the latent after q_a's rows at TP 1, gathered at TP 2),
    Kimi-Linear at TP 2 (the latent split and gathered) and in the checkpoint layout (separate GEMVs): traced in every
    decode step, the logits as close to kernels='off' as test_decode_preps_mla_in_one_kernel's."""
    from small_models import tiny_k3_4l, tiny_kimi_linear_4l

    calls = _on_cpu(monkeypatch, "mla_prep", 0)
    _on_cpu(monkeypatch, "mla_decode_uv", 0)
    cfg = (tiny_k3_4l if which == "k3" else tiny_kimi_linear_4l)(kv_lora_rank=64, qk_rope_head_dim=16)
    a, b = _off_and_auto(cfg, [[5, 6, 7, 8], [9, 3, 2]], calls, tp=tp, layout=layout)
    assert len(calls) >= len(cfg.mla_layers) >= 1, calls
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3 * np.abs(a).max())


@pytest.mark.slow  # interpret-mode kernels inside a model (the kernel's own test is in both suites)
def test_decode_preps_mla_from_the_gemv_partial_sums(monkeypatch, fresh_steps):
    """`mla_prep.PARTIALS` on, with the normed GEMV running (interpret mode, registered for the CPU, K split in two):
    the MLA layer hands mla_prep in_proj's partial sums [2, B, X], and the logits agree with kernels='off' to the bound
    of test_decode_preps_mla_in_one_kernel."""
    from small_models import tiny_kimi_linear_4l

    from jaxk3.kernels import gemv as G
    from jaxk3.kernels import mla_prep as M

    monkeypatch.setattr(M, "PARTIALS", True)
    monkeypatch.setattr(G, "norm_config_for", lambda B, N, K, layout="nk": G.Config(bn=16, bk=K // 2, splits=2))
    calls = _on_cpu(monkeypatch, "mla_prep", 0)
    _on_cpu(monkeypatch, "mla_decode_uv", 0)
    _on_cpu(monkeypatch, "gemv_norm", 0)
    cfg = tiny_kimi_linear_4l(kv_lora_rank=64, qk_rope_head_dim=16)
    a, b = _off_and_auto(cfg, [[5, 6, 7, 8]], calls)
    assert len(calls) >= len(cfg.mla_layers) >= 1 and all(c == (2, 1, calls[0][2]) for c in calls), calls
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3 * np.abs(a).max())


@pytest.mark.parametrize("B,joined", [(1, False), (3, True)])
def test_moe_experts_group_scale_and_f32_input(B, joined):
    """MXFP4 experts with `Config(scale="group")` (each 32-value group's products summed, then times 2^14 and the
    scale) and `x_f32` (the input widened by XLA, not in the loop), interpret mode: `x_f32` gives the default's
    output bitwise (the same float32 values in the same order); "group" the reference's within float32
    reassociation (the products are exact; their sums taken per group, then the groups: 2e-6 of max|ref| as the
    other configurations), with both decodes it supports, for one token (its [bn, g] accumulators) and three (a
    tile's sums per token)."""
    from jaxk3.kernels import moe_experts as ME

    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, B)
    if joined:
        w = _joined(w)
    ref = np.asarray(ME.experts_partial(cfg, w, z, wk, ids))
    run = lambda **c: np.asarray(ME.experts(cfg, w, z, wk, ids, interpret=True, config=ME.Config(
        bn=32, bk=64, **{"mx_dot": False, **c})))  # the element-wise forms (mx_dot has its own test below)
    base = run(scale="weight", x_f32=False)
    np.testing.assert_array_equal(run(scale="weight", x_f32=True), base)
    # the default: the scale per group with the input in float32 for one token; for more, the tensor cores
    np.testing.assert_array_equal(run(mx_dot=None), run(scale="group", x_f32=True) if B == 1 else run(mx_dot=True))
    for c in (dict(scale="group"), dict(scale="group", decode="select"), dict(scale="group", x_f32=True)):
        assert ME.fits(cfg, w, z, wk, ids, config=ME.Config(bn=32, bk=64, **c), only_where_faster=False) is None
        got = run(**c)
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
        assert not np.array_equal(got, np.zeros_like(got))


@pytest.mark.parametrize("B", [3, 8])
@pytest.mark.parametrize("joined", [False, True])
def test_moe_experts_mxfp4_on_the_tensor_cores(B, joined):
    """MXFP4 experts for several tokens with `Config(mx_dot=True)` (the tokens padded to 16 rows, each scale group's
    decoded codes in two bf16 dots, the sums times the group's scale), interpret mode, both decodes it takes and two
    K splits of kernel 2: the reference's exact products summed per group, then across groups, so within float32
    reassociation of it (2e-6 of max|ref|, as every configuration); not bitwise the element-wise form's output (the
    path ran).  `fits` refuses it with the input widened, the "bits" decode or float32 activations, by name."""
    from jaxk3.kernels import moe_experts as ME

    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, B)
    if joined:
        w = _joined(w)
    ref = np.asarray(ME.experts_partial(cfg, w, z, wk, ids))
    run = lambda **c: np.asarray(ME.experts(cfg, w, z, wk, ids, interpret=True, config=ME.Config(
        bn=16, bk=64, **{"f16": False, **c})))  # (the float16 form has its own test)
    base = run(mx_dot=False)
    # the default for several tokens (mx_dot None), where the stacks' scales are not marked float16-exact: the tensor
    # cores with bf16 activations; element-wise where the input is widened (x_f32) or float32, which mx_dot does not
    # take
    w_unmarked = ME.with_f16(w, False)
    np.testing.assert_array_equal(np.asarray(ME.experts(cfg, w_unmarked, z, wk, ids, interpret=True,
                                                        config=ME.Config(bn=16, bk=64))), run(mx_dot=True))
    np.testing.assert_array_equal(run(x_f32=True), run(mx_dot=False, x_f32=True))
    assert ME._rows_padded(w_unmarked, z, None) == 16 and ME._rows_padded(w, z.astype(jnp.float32), None) == (
        4 if B == 3 else 8)
    for c in (dict(mx_dot=True), dict(mx_dot=True, decode="select"), dict(mx_dot=True, splits=1)):
        assert ME.fits(cfg, w, z, wk, ids, config=ME.Config(bn=16, bk=64, **c), only_where_faster=False) is None
        got = run(**c)
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max(), err_msg=str(c))
        assert not np.array_equal(got, base)
    for c, z_ in ((dict(mx_dot=True, x_f32=True), z), (dict(mx_dot=True, decode="bits"), z),
                  (dict(mx_dot=True), z.astype(jnp.float32))):
        assert "mx_dot takes bf16" in ME.fits(cfg, w, z_, wk, ids, config=ME.Config(**c), only_where_faster=False)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("joined", [False, True])
def test_moe_experts_mxfp4_on_f16_tensor_cores(B, joined, monkeypatch):
    """MXFP4 experts with `Config(f16=True)` (every code times its group's scale a float16, exactly, for the scales
    in F16_SCALES; the tokens scaled per row by a power of two into float16; one dot per tile), interpret mode, one
    token and three, two K splits of kernel 2: the reference's exact products in another order (2e-6 of max|ref|, as
    every configuration), and the float16 dot traced in both kernels in the operand order asked for (the path ran;
    its output may equal the group form's bit for bit where this tiny case's sums are exact, as jax 0.12's CPU dot
    makes them at one token)."""
    from jaxk3.kernels import moe_experts as ME

    traced = []
    f16_dot = ME._f16_dot_rows
    monkeypatch.setattr(ME, "_f16_dot_rows", lambda *a, **k: traced.append(a[0].swap) or f16_dot(*a, **k))

    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, B)
    if joined:
        w = _joined(w)
    ref = np.asarray(ME.experts_partial(cfg, w, z, wk, ids))
    run = lambda **c: np.asarray(ME.experts(cfg, w, z, wk, ids, interpret=True, config=ME.Config(bn=16, bk=64, **c)))
    # the tokens padded to 8 rows with the weights as the MMA's M side (`swap`, the default with f16), else 16
    assert ME._rows_padded(w, z, ME.Config(f16=True)) == 8
    assert ME._rows_padded(w, z, ME.Config(f16=True, swap=False)) == 16
    # the default for several tokens where the stacks are marked (the loader marks them: every scale of the test's
    # random weights lies in F16_SCALES); not for one token; a scale outside the range (either end) fails the check
    assert all(m.f16 for m in (w.experts_w2, getattr(w, "experts_w13", None) or w.experts_w1))
    np.testing.assert_array_equal(run(), run(f16=True) if B > 1 else run(f16=False))
    for s in (ME.F16_SCALES[0] - 1, ME.F16_SCALES[1] + 1):
        bad = dataclasses.replace(w.experts_w2, scale=w.experts_w2.scale.at[0, 0, 0].set(s))
        assert not ME.f16_exact(dataclasses.replace(w, experts_w2=bad)) and ME.f16_exact(w)
    unmarked = ME.with_f16(w, False)
    assert "f16 needs MXFP4 stacks" in ME.fits(cfg, unmarked, z, wk, ids, config=ME.Config(f16=True),
                                               only_where_faster=False)
    assert "f16 takes bf16" in ME.fits(cfg, w, z.astype(jnp.float32), wk, ids, config=ME.Config(f16=True),
                                       only_where_faster=False)
    # kernel 2's programs along the slots (slot_splits; 5 parts leave some empty at these few slots): the default
    # rule splits them for the float16 form's short grids (the default 256-column tiles: K3's TP 2 share and TP 1 4;
    # TP 1 in 128-column tiles, 672 programs: 2)
    cf = ME._resolve(ME.Config(), 8, 3584, 1536, 3584, True, f16_ok=True)
    assert (cf.bk, cf.num_stages, cf.swap) == (256, 1, True)
    assert (ME._slot_splits(cf, 3584, 1536), ME._slot_splits(cf, 3584, 3072)) == (4, 4)
    assert ME._slot_splits(dataclasses.replace(cf, bk=128), 3584, 3072) == 2
    assert ME._slot_splits(ME._resolve(ME.Config(), 8, 3584, 1536, 3584, True), 3584, 1536) == 1
    assert ME._slot_splits(ME._resolve(ME.Config(), 1, 3584, 1536, 3584, True), 3584, 1536, one_mx=True) == 4
    assert "slot_splits must be" in ME.fits(cfg, w, z, wk, ids, config=ME.Config(slot_splits=-1),
                                            only_where_faster=False)
    for c in (dict(f16=True), dict(f16=True, splits=1), dict(f16=True, decode="select"),
              dict(f16=True, slot_splits=2), dict(f16=True, slot_splits=5, splits=1), dict(f16=True, swap=False),
              dict(f16=True, swap=False, slot_splits=2)):
        assert ME.fits(cfg, w, z, wk, ids, config=ME.Config(bn=16, bk=64, **c), only_where_faster=False) is None
        traced.clear()
        got = run(**c)
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max(), err_msg=str(c))
        assert len(traced) >= 2 and set(traced) == {c.get("swap", True)}, (c, traced)  # gate-up, down


def test_moe_experts_f16_views_scale_rows_exactly():
    """`_f16_views`: each row times a power of two that puts its largest magnitude in [2^14, 2^15), so bf16 values from
    2^-17 of the maximum up are float16 exactly and none overflows (rows of 1e30 and 1e-30 too), a row of zeros
    stays zeros with factor 1, and the returned 2^-k undoes it exactly."""
    from jaxk3.kernels import moe_experts as ME

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    x[1] *= 1e30
    x[2] *= 1e-30
    x[3] = 0
    xb = jnp.asarray(x, jnp.bfloat16)
    (ve, vo), inv = ME._f16_views(xb)
    v = np.stack([np.asarray(ve, np.float32), np.asarray(vo, np.float32)], -1).reshape(4, 64)
    m = np.abs(v).max(axis=1)
    assert np.all((m[:3] >= 2 ** 14) & (m[:3] < 2 ** 15)) and m[3] == 0 and np.asarray(inv)[3, 0] == 1
    xf = np.asarray(xb, np.float32)
    big = np.abs(xf) >= 2.0 ** -17 * np.abs(xf).max(axis=1, keepdims=True)
    np.testing.assert_array_equal((v * np.asarray(inv))[big], xf[big])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("config", [None, dict(decode="bits"), dict(scale="group", x_f32=True),
                                    dict(bn=32, bk=64, splits=1, decode="select", num_warps=8, num_stages=2),
                                    dict(mx_dot=True), dict(mx_dot=False), dict(decode="asm"),
                                    dict(decode="asm", mx_dot=True), dict(f16=True), dict(f16=True, swap=False),
                                    dict(f16=True, bn=64), dict(swap=True)])
@pytest.mark.parametrize("layout", ["checkpoint", "joined+shared"])
def test_moe_experts_kernel_on_gpu(fmt, B, config, layout):
    """The compiled kernel (Triton) on a GPU against the jnp reference, bf16 activations, in the default
    configuration and two of the sweep's (scripts/gpu/moe_experts_sweep.py); w1 and w3 apart, or joined
    with the shared experts fused (dense; MXFP4 takes the joined experts alone)."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from jaxk3.kernels.moe_experts import Config

    cfg, w, z, wk, ids = _moe_case(fmt, jnp.bfloat16, B)
    shared = None
    if layout != "checkpoint":
        w = _joined(w)
        shared = _shared(w, jnp.bfloat16) if fmt == "dense" else None
    c = Config(**config) if config else None
    assert kernels.explain("moe_experts", cfg, w, z, wk, ids, shared=shared, mode="on", config=c).startswith("device")
    got = np.asarray(jax.jit(lambda *a: kernels.call("moe_experts", cfg, *a, shared=shared, mode="on", config=c))(
        w, z, wk, ids))
    ref = np.asarray(kernels.REGISTRY["moe_experts"].reference(cfg, w, z, wk, ids, shared=shared))
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
def test_moe_experts_asm_decode_on_gpu(B):
    """The compiled "asm" decode (PTX inline assembly, which interpret mode cannot run) against the compiled "f16"
    decode: the same values into the same products and sums, so the same output bit for bit, at one token (the scale
    per group) and at eight (the tensor cores); both within the reference's tolerance (the paths ran)."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda): inline PTX")
    from jaxk3.kernels import moe_experts as ME

    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, B)
    run = {d: np.asarray(jax.jit(lambda *a, d=d: ME.experts(cfg, *a, config=ME.Config(decode=d)))(w, z, wk, ids))
           for d in ("asm", "f16")}
    ref = np.asarray(ME.experts_partial(cfg, w, z, wk, ids))
    np.testing.assert_allclose(run["asm"], ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    np.testing.assert_array_equal(run["asm"], run["f16"])


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("swap", [True, False])
def test_moe_experts_f16_asm_on_gpu(B, swap):
    """The compiled float16 tensor-core form (`Config(f16=True)`) with its PTX decode ("asm": the codes' float16 bits
    times the scale by mul.rn.f16x2) against the same form with Triton's decode ("f16": the float32 raw values times
    the scale, rounded to float16): the same float16 values into the same dots, so the same output bit for bit; both
    within the reference's tolerance.  With the weights as the MMA's M side (`swap`) Triton may pack two rows' pairs
    into one asm word: each pair must take its own scale."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda): inline PTX")
    from jaxk3.kernels import moe_experts as ME

    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, B)
    run = {d: np.asarray(jax.jit(lambda *a, d=d: ME.experts(cfg, *a, config=ME.Config(decode=d, f16=True, swap=swap)))(
        w, z, wk, ids)) for d in ("asm", "f16")}
    ref = np.asarray(ME.experts_partial(cfg, w, z, wk, ids))
    np.testing.assert_allclose(run["asm"], ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    np.testing.assert_array_equal(run["asm"], run["f16"])


# ------------------------------------------------------------------ moe_grouped (prefill)
def _grouped_case(fmt: str, N: int, fused: bool, seed: int = 0):
    """A tiny K3 MoE layer (bf16, dense or MXFP4 experts, w1|w3 stacked as the serving layout does
    when `fused`), N routed tokens; one token's experts are all the first token's (shared groups)."""
    cfg, w, _, _, _ = _moe_case(fmt, jnp.bfloat16, 1, seed)
    from jaxk3.layers import moe

    rng = np.random.default_rng(seed + N)
    wk, ids = moe.route(cfg, w.gate, w.e_score_correction_bias,
                        jnp.asarray(rng.standard_normal((N, cfg.hidden_size)), jnp.bfloat16))
    ids = ids.at[-1].set(ids[0])
    if fused:
        w = _joined(w)
    z = jnp.asarray(rng.standard_normal((N, cfg.moe_hidden)), jnp.bfloat16)
    return cfg, w, z, wk, ids


def test_moe_grouped_align():
    """`align`: every (token, slot) pair has its own row, in a block of its expert; a block holds one
    expert; padding rows point past the tokens; unused blocks (-1) come last; the block count is
    Σ ceil(n_e / bm) within the static bound."""
    from jaxk3.kernels.moe_grouped import align, num_blocks

    rng = np.random.default_rng(3)
    N, k, E, bm = 37, 3, 10, 4
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    ids[ids == 7] = 2  # expert 7 gets no rows (2 may then repeat within a token: still one row per pair)
    pos, src, expert = (np.asarray(a) for a in align(jnp.asarray(ids), E, bm))
    assert expert.shape == (num_blocks(N * k, E, bm),) and src.shape == (expert.size * bm,)
    assert len(set(pos.ravel())) == N * k
    np.testing.assert_array_equal(expert[pos // bm], ids)
    np.testing.assert_array_equal(src[pos], np.repeat(np.arange(N), k).reshape(N, k))
    pad = np.ones(src.size, bool)
    pad[pos.ravel()] = False
    assert np.all(src[pad] == N)
    sizes = np.bincount(ids.ravel(), minlength=E)
    used = int(np.sum(-(-sizes // bm)))
    assert np.all(expert[:used] >= 0) and np.all(expert[used:] == -1) and 7 not in expert
    assert np.all(np.diff(expert[:used]) >= 0)  # groups in expert order
    # the layout is exactly a stable sort's: each expert's pairs in (token, slot) order from its first row
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")
    first = np.concatenate([[0], np.cumsum(-(-sizes // bm))[:-1]]) * bm
    want = np.empty_like(flat)
    want[order] = first[flat[order]] + np.arange(flat.size) - (np.cumsum(sizes) - sizes)[flat[order]]
    np.testing.assert_array_equal(pos.ravel(), want)



def test_moe_grouped_layout_has_no_loop():
    """The grouped MoE's layout and combine (the XLA part of the prefill's MoE around its two kernels) lower to no
    while loop: a GPU runs a loop one step at a time (each step's small kernels and its condition in turn), which
    cost the prefill ~0.3 ms a MoE layer while `blocks_of` used jnp.searchsorted's default scan (docs/PERF.md,
    fifteenth session).  The scan form is still one, so this test would see it come back."""
    from jaxk3.kernels import moe_grouped as G

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (512, 8)), jnp.int32)
    wk = jnp.ones((512, 8), jnp.float32)
    y = jnp.ones((G.num_blocks(512 * 8, 256, 64) * 64, 32), jnp.float32)

    def layout(ids, wk, y):
        pos, src, expert = G.align(ids, 256, 64)
        return G.combine(y, pos, wk), src, expert

    assert "stablehlo.while" not in jax.jit(layout).lower(ids, wk, y).as_text()
    assert "stablehlo.while" in jax.jit(lambda s: jnp.searchsorted(s, jnp.arange(768), side="right")).lower(
        jnp.arange(256)).as_text()


@pytest.mark.parametrize("fmt,fused", [("dense", False), ("dense", True), ("mxfp4", True)])
@pytest.mark.parametrize("N,order,gather", [(5, "m", False), (13, "n", True)])
def test_moe_grouped_kernel_matches_reference(fmt, fused, N, order, gather):
    """Interpret mode against the dense form (the reference, today's prefill path) and the ragged_dot
    form.  Tolerance 4e-3 of max|ref|: bf16 operands and fp32 sums on every path, but in another
    order, and the [N, I] activations are rounded to bf16 from those sums, so single elements may
    land one bf16 ulp (2^-8) apart before the down projection; a wrong expert, row, weight or
    activation half is off by >= 1e-1 of it."""
    from jaxk3.kernels import moe_grouped as G

    cfg, w, z, wk, ids = _grouped_case(fmt, N, fused)
    c = G.Config(bm=16, bn=32, bk=32, order=order, gather=gather)
    assert G.fits(cfg, w, z, wk, ids, config=c) is None
    got = np.asarray(G.grouped(cfg, w, z, wk, ids, config=c, interpret=True))
    for ref in (G.experts_dense(cfg, w, z, wk, ids), G.experts_grouped(cfg, w, z, wk, ids)):
        ref = np.asarray(ref)
        assert got.shape == ref.shape == (N, cfg.moe_hidden) and np.abs(ref).max() > 0
        np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * np.abs(ref).max())


def test_moe_grouped_down_blocks():
    """`down_blocks` (Config.down_bm): each down_bm-row sub-block of the bm-row layout has its block's expert where
    it holds a real row and -1 where it holds padding only, so kernel 2 computes every real row once and skips the
    rest; without down_bm the layout's own blocks."""
    from jaxk3.kernels import moe_grouped as G

    rng = np.random.default_rng(4)
    N, k, E = 41, 3, 6
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    ids[:30][ids[:30] == 5] = 4  # expert 5: 8 rows (one sub-block of 16), expert 4: 29 rows
    # and an exact fill: 48 tokens, expert 3 on tokens 0-31 (32 rows: one 32-row block, two of 64's 16-row quarters),
    # expert 4 on tokens 32-47, experts 0-2 16 rows each, expert 5 none
    t = np.arange(48)
    exact = np.stack([t % 3, np.where(t < 32, 3, 4)], axis=1).astype(np.int32)
    for ids, bm, dbm in ((ids, 32, 16), (ids, 64, 16), (exact, 32, 16), (exact, 64, 16), (exact, 128, 32)):
        n = ids.shape[0]
        pos, src, expert = (np.asarray(a) for a in G.align(jnp.asarray(ids), E, bm))
        c = G.Config(bm=bm, bn=32, bk=32, num_warps=8, down_bm=dbm, down_warps=4)
        sub, cd = G.down_blocks(jnp.asarray(expert), jnp.asarray(src), n, c)
        sub = np.asarray(sub)
        assert (cd.bm, cd.num_warps, cd.down_bm) == (dbm, 4, 0) and sub.shape == (expert.size * bm // dbm,)
        real = src < n
        for s_ in range(sub.size):
            rows = real[s_ * dbm:(s_ + 1) * dbm]
            assert sub[s_] == (expert[s_ * dbm // bm] if rows.any() else -1), (bm, dbm, s_)
        # every pair's row is in a computed sub-block of its expert; some padding-only parts of used blocks skipped
        np.testing.assert_array_equal(sub[pos // dbm], ids)
        assert (sub == -1).sum() > (expert == -1).sum() * (bm // dbm), (bm, dbm)
    same, c_same = G.down_blocks(jnp.asarray(expert), jnp.asarray(src), n, dataclasses.replace(c, down_bm=0,
                                                                                               down_warps=0))
    assert c_same.bm == 128 and np.array_equal(np.asarray(same), expert)
    cfg, w, z, wk, ids = _grouped_case("dense", 13, True)
    c = G.Config(bm=32, bn=32, bk=32, num_warps=8, down_bm=16, down_warps=4)
    for bad in (dict(down_bm=8), dict(down_bm=48), dict(down_bm=64), dict(down_warps=2), dict(down_bn=24),
                dict(down_bn=8), dict(down_stages=-1)):
        assert "down_" in G.fits(cfg, w, z, wk, ids, config=dataclasses.replace(c, **bad)), bad
    assert "Triton" in G.fits(cfg, w, z, wk, ids, config=G.Config(bm=64, bn=64, bk=64, backend="mosaic", mask=True))
    # kernel 2's own tiling, on the layout's blocks or on their halves
    own = dataclasses.replace(c, down_bm=0, down_bn=16, down_stages=2, down_warps=4)
    assert G.fits(cfg, w, z, wk, ids, config=own) is None
    _, c2 = G.down_blocks(jnp.asarray(expert), jnp.asarray(src), n, own)
    assert (c2.bm, c2.bn, c2.num_stages, c2.num_warps, c2.down_bn) == (32, 16, 2, 4, 0)


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_moe_grouped_split_down_matches(fmt):
    """Interpret mode: gate|up on 32-row blocks and down on their 16-row halves (`down_bm`) against the dense form
    (test_moe_grouped_kernel_matches_reference's 4e-3 of max|ref|) and against the same layout with down on whole
    blocks, bitwise: each output row is the same products summed in the same order, only skipped halves differ."""
    from jaxk3.kernels import moe_grouped as G

    cfg, w, z, wk, ids = _grouped_case(fmt, 29, True)
    ids = ids.at[:, 0].set(ids[0, 0])  # one expert on every token's first slot: 29+ rows, both halves of its block real
    whole = G.Config(bm=32, bn=32, bk=32, order="n")
    split = dataclasses.replace(whole, down_bm=16, down_warps=4)
    assert G.fits(cfg, w, z, wk, ids, config=split) is None
    got = np.asarray(G.grouped(cfg, w, z, wk, ids, config=split, interpret=True))
    ref = np.asarray(G.experts_dense(cfg, w, z, wk, ids))
    assert np.abs(ref).max() > 0
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * np.abs(ref).max())
    np.testing.assert_array_equal(got, np.asarray(G.grouped(cfg, w, z, wk, ids, config=whole, interpret=True)))


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_moe_grouped_masked_padding_matches(fmt):
    """Interpret mode: the padding rows masked out of both kernels' loads and stores (`mask`), with kernel 2 on the
    layout's blocks, on their halves, on its own columns and pipeline depth (`down_bn`, `down_stages`), and on the
    sorted copy of the inputs: bitwise the unmasked form (each real row's products are the same); kernel 1's real
    rows alone are the unmasked form's too, in a layout that has padding rows in used blocks."""
    from jaxk3.kernels import moe_grouped as G

    cfg, w, z, wk, ids = _grouped_case(fmt, 29, True)
    ids = ids.at[:, 0].set(ids[0, 0])  # one expert on every token's first slot: 29+ rows, a block and a part of one
    base = G.Config(bm=32, bn=32, bk=32, order="n")
    want = np.asarray(G.grouped(cfg, w, z, wk, ids, config=base, interpret=True))
    ref = np.asarray(G.experts_dense(cfg, w, z, wk, ids))
    np.testing.assert_allclose(want, ref, rtol=0, atol=4e-3 * np.abs(ref).max())
    L = cfg.moe_hidden
    R = dataclasses.replace
    for c in (R(base, mask=True), R(base, mask=True, down_bm=16, down_warps=4), R(base, mask=True, gather=False),
              R(base, down_bn=16, down_stages=2), R(base, mask=True, down_bn=L if L <= 128 else 64)):
        assert G.fits(cfg, w, z, wk, ids, config=c) is None, c
        np.testing.assert_array_equal(np.asarray(G.grouped(cfg, w, z, wk, ids, config=c, interpret=True)), want,
                                      err_msg=str(c))
    c = R(base, mask=True)
    pos, expert, src, xs = G.prepare(w, z, ids, c)
    a = np.asarray(G.gate_up(cfg, w, expert, src, xs, c, interpret=True, num_tokens=z.shape[0]))
    a0 = np.asarray(G.gate_up(cfg, w, expert, src, xs, base, interpret=True))
    real = np.asarray(src) < z.shape[0]
    used = np.repeat(np.asarray(expert) >= 0, c.bm)
    np.testing.assert_array_equal(a[real], a0[real])
    assert np.any(used & ~real) and np.abs(a0[real]).max() > 0
    with pytest.raises(ValueError, match="num_tokens"):
        G.down(w, expert, jnp.asarray(a), c, interpret=True)


def _wide_grouped_case(N: int = 29, E: int = 4, I: int = 128, L: int = 128, seed: int = 5):
    """Random bf16 experts in the serving layout (w1|w3 joined) wider than the tiny K3's (I 128, for bn 128), top-2
    of E, N tokens: the tiny K3 config's activation and routing scale."""
    from jaxk3.config import KimiK3Config
    from jaxk3.layers import moe

    cfg = dataclasses.replace(KimiK3Config.tiny_k3(), num_experts=E, num_experts_per_token=2, moe_intermediate_size=I)
    rng = np.random.default_rng(seed)
    w = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=None, experts_w3=None,
                       experts_w2=jnp.asarray(rng.standard_normal((E, L, I)) * 0.05, jnp.bfloat16),
                       experts_w13=jnp.asarray(rng.standard_normal((E, 2 * I, L)) * 0.05, jnp.bfloat16))
    ids = jnp.asarray(np.stack([rng.choice(E, 2, replace=False) for _ in range(N)]), jnp.int32)
    wk = jnp.asarray(rng.uniform(0.2, 1.0, (N, 2)), jnp.float32)
    return cfg, w, jnp.asarray(rng.standard_normal((N, L)), jnp.bfloat16), wk, ids


@pytest.mark.parametrize("fmt,fused", [("dense", True), ("dense", False), ("mxfp4", True)])
def test_moe_grouped_mosaic_matches_reference(fmt, fused):
    """The Mosaic GPU form of the grouped GEMMs (`Config(backend="mosaic")`: TMA tiles, wgmma, a persistent grid that
    skips unused blocks) in Mosaic GPU's own interpreter against the dense form, the tolerance of the Triton form's
    test (4e-3 of max|ref|: bf16 operands, fp32 sums in another order, the activations rounded to bf16); `fits` names
    the tiles it cannot take."""
    from jaxk3.kernels import moe_grouped as G
    from jaxk3.kernels import moe_grouped_mgpu as MG

    if MG.interpret_params() is None:
        pytest.skip(f"jax {jax.__version__} has no Mosaic GPU interpreter (InterpretGPUParams); the Python 3.12 suite's "
                    "newest jax runs this test")
    cfg, w, z, wk, ids = _grouped_case(fmt, 13, fused)
    c = G.Config(bm=64, bn=64, bk=64, num_stages=2, backend="mosaic", width=1)
    ref = np.asarray(G.experts_dense(cfg, w, z, wk, ids))
    assert np.abs(ref).max() > 0
    assert G.fits(cfg, w, z, wk, ids, config=c) is None
    got = np.asarray(G.grouped(cfg, w, z, wk, ids, config=c, interpret=True))
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * np.abs(ref).max())
    if fmt == "dense" and fused:  # the warp-specialised gate|up: bn 128, wider experts than the tiny K3's
        cfg, w, z, wk, ids = _wide_grouped_case()
        ws = G.Config(bm=64, bn=128, bk=64, num_stages=2, backend="mosaic_ws", width=1)
        assert G.fits(cfg, w, z, wk, ids, config=ws) is None
        ref = np.asarray(G.experts_dense(cfg, w, z, wk, ids))
        got = np.asarray(G.grouped(cfg, w, z, wk, ids, config=ws, interpret=True))
        np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * np.abs(ref).max())
    cfg, w, z, wk, ids = _wide_grouped_case()  # I = L = 128: the refusals below are the mosaic rules, not tiling
    for bad, why in ((dict(bm=32), "multiple of 64"), (dict(bk=32), "bk 64"), (dict(bn=32), "bn 64, 128 or 256"),
                     (dict(bm=128, bn=128), "two fp32 accumulators"), (dict(backend="cuda"), "backend must be"),
                     (dict(backend="mosaic_ws"), "bn 128 or 256")):
        assert why in G.fits(cfg, w, z, wk, ids, config=dataclasses.replace(c, **bad)), bad


def test_moe_grouped_selection(monkeypatch):
    """Proven on an H200 at the 48B dims (docs/PERF.md): auto takes it on a GPU, the CPU keeps the dense
    form; fp32 experts and tiles that do not divide the experts' dims are named; bm follows the mean rows
    per expert up to 64 (the measured best), from 128 rows an expert 128-row blocks with down in 3 stages, the
    padding masked at every tiling (`MASK`; off: the form before, down on the blocks' 64-row halves)."""
    from jaxk3.kernels import moe_grouped as G

    cfg, w, z, wk, ids = _grouped_case("dense", 5, True)
    assert kernels.explain("moe_grouped", cfg, w, z, wk, ids, platform="gpu").startswith("device")
    assert kernels.explain("moe_grouped", cfg, w, z, wk, ids, platform="gpu", mode="on").startswith("device")
    assert "platform 'cpu'" in kernels.explain("moe_grouped", cfg, w, z, wk, ids, platform="cpu")
    w32 = jax.tree.map(lambda a: a.astype(jnp.float32), w)
    assert "bf16" in G.fits(cfg, w32, z.astype(jnp.float32), wk, ids)
    assert "must divide the experts' I = 64" in G.fits(cfg, w, z, wk, ids, config=G.Config(bn=128))
    # at 128 rows an expert and more: 128-row blocks on 8 warps, the padding masked, down in 3 stages
    assert G.config_for(4096 * 8, 256, 1024, 2304) == G.Config(bm=128, bn=128, bk=64, num_warps=8, num_stages=4,
                                                               order="n", down_stages=3, mask=True)
    assert G.config_for(4095 * 8, 256, 1024, 2304) == G.Config(bm=64, bn=128, bk=64, num_stages=4, order="n",
                                                               mask=True)
    assert G.config_for(512 * 8, 256, 1024, 2304).bm == 16
    assert G.config_for(5 * 4, 16, 64, 128) == G.Config(bm=16, bn=64, bk=64, order="n", mask=True)
    monkeypatch.setattr(G, "MASK", False)  # the form before the fortieth session: down on the blocks' 64-row halves
    assert G.config_for(4096 * 8, 256, 1024, 2304) == G.Config(bm=128, bn=128, bk=64, num_warps=8, num_stages=4,
                                                               order="n", down_bm=64, down_warps=4)
    assert not G.config_for(512 * 8, 256, 1024, 2304).mask


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,fused", [("dense", False), ("dense", True), ("mxfp4", True)])
@pytest.mark.parametrize("order,gather", [("m", False), ("n", False), ("n", True)])
def test_moe_grouped_kernel_on_gpu(fmt, fused, order, gather):
    """The compiled kernels (Triton) on a GPU against the dense form, tolerance as in interpret mode,
    with either grid order, the inputs sorted or gathered by the kernel."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from jaxk3.kernels import moe_grouped as G

    cfg, w, z, wk, ids = _grouped_case(fmt, 13, fused)
    c = G.Config(bm=16, bn=32, bk=32, order=order, gather=gather)
    got = np.asarray(jax.jit(lambda *a: G.grouped(cfg, *a, config=c))(w, z, wk, ids))
    ref = np.asarray(G.experts_dense(cfg, w, z, wk, ids))
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * np.abs(ref).max())
    if order == "n" and gather:  # down on the 16-row halves of 32-row blocks (`down_bm`), 8 and 4 warps: same bits
        whole = G.Config(bm=32, bn=32, bk=32, num_warps=8, order="n")
        split = dataclasses.replace(whole, down_bm=16, down_warps=4)
        a, b = (np.asarray(jax.jit(lambda *a, c=c: G.grouped(cfg, *a, config=c))(w, z, wk, ids)) for c in (whole, split))
        np.testing.assert_allclose(b, ref, rtol=0, atol=4e-3 * np.abs(ref).max())
        np.testing.assert_array_equal(a, b)
        # the padding masked (`mask`), kernel 2 on its own columns and depth, on the blocks or their halves: same bits
        R = dataclasses.replace
        for m in (R(split, mask=True), R(whole, mask=True, down_bn=16, down_stages=2, down_warps=4),
                  R(split, mask=True, down_bn=16, down_warps=8), R(whole, mask=True, gather=False)):
            got = np.asarray(jax.jit(lambda *a, c=m: G.grouped(cfg, *a, config=c))(w, z, wk, ids))
            np.testing.assert_array_equal(got, a, err_msg=str(m))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,fused", [("dense", True), ("dense", False), ("mxfp4", True)])
def test_moe_grouped_mosaic_on_gpu(fmt, fused):
    """The compiled Mosaic GPU form (TMA, wgmma) on a GPU against the dense form, tolerance as in the interpreter."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda): Mosaic GPU compiles for Hopper")
    from jaxk3.kernels import moe_grouped as G

    cfg, w, z, wk, ids = _grouped_case(fmt, 13, fused)
    for c in (G.Config(bm=64, bn=64, bk=64, num_stages=2, backend="mosaic", width=1),
              G.Config(bm=64, bn=64, bk=64, num_stages=4, backend="mosaic", width=4),
              G.Config(bm=64, bn=128, bk=64, num_stages=4, backend="mosaic_ws", width=4)):
        if c.backend == "mosaic_ws":  # bn 128: wider experts than the tiny K3's
            cfg, w, z, wk, ids = _wide_grouped_case()
        got = np.asarray(jax.jit(lambda *a: G.grouped(cfg, *a, config=c))(w, z, wk, ids))
        ref = np.asarray(G.experts_dense(cfg, w, z, wk, ids))
        np.testing.assert_allclose(got, ref, rtol=0, atol=4e-3 * np.abs(ref).max(), err_msg=str(c))


@pytest.mark.slow  # the first suite only: CLI plumbing; the newest jax takes its kernel paths in the tests above
def test_bench_kernels_cli(capsys, tmp_path):
    """`jaxk3 bench kernels` on the CPU (interpret mode, so plumbing, not speed): every (format, batch,
    path) row, the bytes of the distinct experts read, ratios against the bf16 XLA path in the same run."""
    import json

    from jaxk3 import cli

    out_json = tmp_path / "k.json"
    rc = cli.main(["bench", "kernels", "--config", "tiny", "--tp", "1", "--experts", "16", "--batch", "1,3",
                   "--chain", "1", "--repeats", "1", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0 and "interpret mode" in out
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["format"], r["batch"], r["path"]) for r in rows} == {
        (f, b, p) for f in ("bf16", "mxfp4") for b in (1, 3) for p in ("xla", "kernel")}
    by = {(r["format"], r["batch"]): r["bytes"] for r in rows}
    assert by[("mxfp4", 1)] / by[("bf16", 1)] == pytest.approx(17 / 64)  # packed bytes: nibble + 1/32 scale
    assert by[("bf16", 3)] > by[("bf16", 1)]  # more distinct experts at B=3
    assert all(r["us"] > 0 for r in rows)
    assert cli.main(["bench", "kernels", "--config", "tiny", "--experts", "2"]) == 2


# ------------------------------------------------------------------ kda_decode
def _kda_case(mode: str, dtype, B: int, seed: int = 0):
    """Random inputs of one KDA layer's decode core (tiny K3: sigmoid gate with lower bound; tiny
    Kimi-Linear: softplus gate), caches non-zero, the last row invalid when B > 1."""
    from jaxk3.config import KimiK3Config
    from jaxk3.layers import kda

    cfg = KimiK3Config.tiny_k3() if mode == "k3" else KimiK3Config.tiny_kimi_linear()
    C, H, Kd, K = cfg.kda_dim, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    r = np.random.default_rng(seed + B)

    def a(*shape, s=1.0, dt=jnp.float32):
        return jnp.asarray(r.standard_normal(shape) * s, dt)
    cw = kda.CoreWeights(conv_3CK=a(3, C, K, s=0.3), dt_bias_C=a(C), A_log_H=jnp.log(jnp.asarray(r.uniform(1, 16, H), jnp.float32)),
                         o_norm_K=1 + a(Kd, s=0.1))
    valid = jnp.asarray([True] * (B - 1) + [B == 1], bool)
    return cfg, (a(B, 3, C, dt=dtype), a(B, 3, C, K - 1, dt=dtype), cw, a(B, C), jax.nn.sigmoid(a(B, H)),
                 a(B, C), a(B, H, Kd, Kd, s=0.1), valid)


@pytest.mark.parametrize("mode", ["k3", "kl"])
# tiny head_dim 32: one value block per head (bv 32), or four (bv 8); each dtype and batch meets both
@pytest.mark.parametrize("dtype,B,bv", [(jnp.float32, 1, 32), (jnp.float32, 3, 8), (jnp.bfloat16, 1, 8),
                                        (jnp.bfloat16, 3, 32)])
def test_kda_decode_kernel_matches_reference(mode, dtype, B, bv):
    """Interpret mode against `kda.decode_core`.  Tolerance: the same float32 arithmetic with the conv
    taps and the state contractions (32 terms) summed in another order: ~1e-7 relative per value,
    and the output RMSNorm divides by a norm of the same rounding; 1e-5 of max|ref| (a wrong tap,
    gate or update is off by >= 1e-2).  The conv window (a copy) is bitwise; invalid rows keep both
    caches bitwise."""
    from jaxk3.kernels.kda_decode import Config

    cfg, args = _kda_case(mode, dtype, B)
    k = kernels.REGISTRY["kda_decode"]
    assert k.fits(cfg, *args, config=Config(bv=bv)) is None
    assert "float32 state in place" in k.fits(cfg, *args[:6], args[6].astype(jnp.bfloat16), args[7])
    got = k.device(cfg, *args, interpret=True, config=Config(bv=bv))
    ref = k.reference(cfg, *args)
    for g, r_ in zip(got, ref):
        assert g.shape == r_.shape and g.dtype == r_.dtype
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=0, atol=1e-5 * float(jnp.abs(ref[0]).max()))
    np.testing.assert_array_equal(np.asarray(got[1].astype(jnp.float32)), np.asarray(ref[1].astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), rtol=0, atol=1e-5 * float(jnp.abs(ref[2]).max()))
    if B > 1:  # the invalid row kept its state exactly
        np.testing.assert_array_equal(np.asarray(got[2][-1]), np.asarray(args[6][-1]))
        assert not np.array_equal(np.asarray(got[2][0]), np.asarray(args[6][0]))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["k3", "kl"])
@pytest.mark.parametrize("bv", [32, 8])
def test_kda_decode_kernel_on_gpu(mode, bv):
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from jaxk3.kernels.kda_decode import Config

    cfg, args = _kda_case(mode, jnp.bfloat16, 3)
    got = jax.jit(lambda *a: kernels.call("kda_decode", cfg, *a, mode="on", config=Config(bv=bv)))(*args)
    ref = kernels.REGISTRY["kda_decode"].reference(cfg, *args)
    for g, r_ in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)), np.asarray(r_.astype(jnp.float32)), rtol=0,
                                   atol=1e-4 * float(jnp.abs(r_.astype(jnp.float32)).max()))


def _kda_in_case(dtype, B: int, seed: int = 0, real: bool = False):
    """Kimi-Linear's serving-layout decode inputs: in_proj's raw output [q | k | v | f_a | b | g_a] (fp32,
    random, not rounded to the activation dtype, so the kernel's casts matter) and the stacked [f_b, g_b];
    `real`: at Kimi-Linear-48B's dims (32 heads of 128, conv 4)."""
    cfg, args = _kda_case("kl", dtype, B, seed)
    if real:
        from jaxk3.tools.bench_decode import load_config

        cfg = load_config("kimi-linear-48b")
        C, H, Kd, K = cfg.kda_dim, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
        r = np.random.default_rng(seed)

        def a(*shape, s=1.0, dt=jnp.float32):
            return jnp.asarray(r.standard_normal(shape) * s, dt)
        from jaxk3.layers import kda
        cw = kda.CoreWeights(conv_3CK=a(3, C, K, s=0.3), dt_bias_C=a(C),
                             A_log_H=jnp.log(jnp.asarray(r.uniform(1, 16, H), jnp.float32)), o_norm_K=1 + a(Kd, s=0.1))
        args = (None, a(B, 3, C, K - 1, dt=dtype), cw, None, None, None, a(B, H, Kd, Kd, s=0.1),
                jnp.asarray([True] * (B - 1) + [B == 1], bool))
    u, conv, cw, f, beta, z, state, valid = args
    C, H, d = cfg.kda_dim, cfg.kda_num_heads, cfg.kda_head_dim
    r = np.random.default_rng(seed + 11)
    y = jnp.asarray(r.standard_normal((B, 3 * C + 2 * d + H)), jnp.float32)
    gb = jnp.asarray(r.standard_normal((2, C, d)) * d ** -0.5, dtype)
    return cfg, (y, gb, conv, cw, state, valid)


@pytest.mark.parametrize("dtype,B,bv", [(jnp.bfloat16, 1, 32), (jnp.bfloat16, 3, 8), (jnp.float32, 3, 32),
                                        (jnp.float32, 1, 8)])
def test_kda_decode_in_kernel_matches_reference(dtype, B, bv):
    """The form that reads in_proj's output and the low-rank weights itself (interpret mode) against
    `glue` then `decode_core` (XLA's path): tolerance as kda_decode's, plus the two low-rank products'
    d-term fp32 sums in another order (~1e-7 relative); the conv window is the same cast of y (bitwise)."""
    from jaxk3.kernels.kda_decode import Config, glue

    cfg, args = _kda_in_case(dtype, B)
    k = kernels.REGISTRY["kda_decode_in"]
    assert k.fits(cfg, *args, config=Config(bv=bv), only_where_faster=False) is None
    got = k.device(cfg, *args, interpret=True, config=Config(bv=bv))
    ref = k.reference(cfg, *args)
    tol = 1e-5 if dtype == jnp.float32 else 1e-4
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=0, atol=tol * float(jnp.abs(ref[0]).max()))
    np.testing.assert_array_equal(np.asarray(got[1].astype(jnp.float32)), np.asarray(ref[1].astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), rtol=0, atol=tol * float(jnp.abs(ref[2]).max()))
    # the glue matters: without the low-rank products (f = z = 0) the output is another one
    u, f, beta, z = glue(cfg, args[0], args[1], args[2].dtype)
    other = kernels.REGISTRY["kda_decode"].reference(cfg, u, args[2], args[3], 0 * f, beta, 0 * z, *args[4:])
    assert np.abs(np.asarray(other[0]) - np.asarray(ref[0])).max() > 0.1 * float(jnp.abs(ref[0]).max())
    bad = jnp.zeros((B, args[0].shape[1] + 1), jnp.float32)
    assert "in_proj's output must be" in k.fits(cfg, bad, *args[1:], only_where_faster=False)
    # auto takes it only where the step was measured with it (48B dims, B = 1, bf16); kernels="on" wherever it fits
    assert "measured faster" in k.fits(cfg, *args)
    assert kernels.explain("kda_decode_in", cfg, *args, mode="on", platform="gpu").startswith("device")
    s = jax.ShapeDtypeStruct
    real, rargs = _kda_in_case(jnp.bfloat16, 1, real=True)
    shapes = [s(a.shape, a.dtype) if hasattr(a, "shape") else a for a in rargs]
    assert k.fits(real, *shapes) is None
    y8 = s((8, shapes[0].shape[1]), jnp.float32)
    assert "measured faster" in k.fits(real, y8, *shapes[1:])
    assert "stacked [f_b, g_b]" in k.fits(cfg, args[0], args[1][:1], *args[2:], only_where_faster=False)


@pytest.mark.gpu
@pytest.mark.parametrize("bv,real,B", [(32, False, 3), (8, False, 3), (32, True, 1), (32, True, 8)])
def test_kda_decode_in_kernel_on_gpu(bv, real, B):
    """Compiled, at the tiny dims and at Kimi-Linear-48B's (B 1 and 8), against glue + decode_core."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from jaxk3.kernels.kda_decode import Config

    cfg, args = _kda_in_case(jnp.bfloat16, B, real=real)
    c = Config(bv=bv)
    got = jax.jit(lambda *a: kernels.call("kda_decode_in", cfg, *a, mode="on", config=c))(*args)
    ref = kernels.REGISTRY["kda_decode_in"].reference(cfg, *args)
    for g, r_ in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)), np.asarray(r_.astype(jnp.float32)), rtol=0,
                                   atol=1e-4 * float(jnp.abs(r_.astype(jnp.float32)).max()))


def _as_ring(conv_B3CW: jax.Array, pos_B: np.ndarray) -> jax.Array:
    """The shift form's window (K-1 slots, oldest first) as the ring of K slots at the rows' positions: tap t in
    slot (pos + 1 + t) mod K; the slot this step writes (pos mod K) poisoned with NaN, which no program may read."""
    B, _, C, W = conv_B3CW.shape
    ring = np.full((B, 3, C, W + 1), np.nan, np.float32)
    for b, p in enumerate(pos_B):
        for t in range(W):
            ring[b, ..., (p + 1 + t) % (W + 1)] = np.asarray(conv_B3CW[b, ..., t].astype(jnp.float32))
    return jnp.asarray(ring, conv_B3CW.dtype)


@pytest.mark.parametrize("fused,B,bv", [(False, 3, 8), (False, 1, 32), (True, 3, 8), (True, 1, 32)])
def test_kda_decode_ring_equals_the_shift_form(fused, B, bv):
    """The kernels with the conv cache as a ring written in place (`kda_decode.RING`; interpret mode), against
    the same kernel in the shift form and against the ring's reference: the output and the state the shift form's
    (the same taps summed in the same order: bitwise but for XLA's CPU compile of interpret mode, which may contract
    a product and a sum into one FMA in one form and not the other: jax 0.12.1 put 1 ulp on 10 of 8192 state
    elements; so at most 2 ulp, and 99% bitwise), the ring bitwise the reference's (this token's slot written, the
    other K-1 as they were; the invalid row's ring untouched), and the slot being written, poisoned with NaN, never
    read."""
    from jaxk3.kernels.kda_decode import Config, ring_window

    name = "kda_decode_in" if fused else "kda_decode"
    cfg, args = _kda_in_case(jnp.bfloat16, B) if fused else _kda_case("kl", jnp.bfloat16, B)
    at = 2 if fused else 1  # the conv cache's place among the arguments
    pos = np.asarray([5, 0, 6][:B] if B > 1 else [7], np.int32)
    ring = _as_ring(args[at], pos)
    rargs = (*args[:at], ring, *args[at + 1:])
    k, c = kernels.REGISTRY[name], Config(bv=bv)
    kw = dict(only_where_faster=False) if fused else {}
    assert k.fits(cfg, *rargs, config=c, pos_B=jnp.asarray(pos), **kw) is None
    assert "K-1" in k.fits(cfg, *rargs, config=c, **kw)  # a ring without the positions
    shift = k.device(cfg, *args, interpret=True, config=c)
    got = k.device(cfg, *rargs, interpret=True, config=c, pos_B=jnp.asarray(pos))
    ref = k.reference(cfg, *rargs, pos_B=jnp.asarray(pos))
    assert np.isfinite(np.asarray(got[0])).all() and np.isfinite(np.asarray(got[2])).all()
    for a, b in ((got[0], shift[0]), (got[2], shift[2])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_array_max_ulp(a, b, maxulp=2)
        assert np.mean(a == b) >= 0.99, np.mean(a == b)
    np.testing.assert_array_equal(np.asarray(got[1].astype(jnp.float32)), np.asarray(ref[1].astype(jnp.float32)))
    # the ring read at the next positions is the shift form's moved window
    nxt = jnp.asarray(pos + np.asarray(args[-1]).astype(np.int32))
    np.testing.assert_array_equal(np.asarray(ring_window(got[1], nxt).astype(jnp.float32)),
                                  np.asarray(shift[1].astype(jnp.float32)))
    if B > 1:  # the invalid row's ring as it was, poison included
        np.testing.assert_array_equal(np.asarray(got[1][-1].astype(jnp.float32)), np.asarray(ring[-1].astype(jnp.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("fused,real,B,bv", [(True, False, 3, 8), (False, False, 3, 8), (True, True, 1, 32),
                                             (True, True, 8, 32), (False, True, 8, 16)])
def test_kda_decode_ring_on_gpu(fused, real, B, bv):
    """Compiled, both kernels with the ring (tiny dims with four programs a head, and Kimi-Linear-48B's, B 1 and 8)
    under jit with the ring donated (in place, as in the step), where a program reading a slot another one wrote
    would show (interpret mode cannot: its aliased output is a copy): the output and state within kda_decode's GPU
    bound of the ring's reference, the ring bitwise.  The projections' form (`kda_decode`, K3's) takes the
    serving case's inputs through `glue`."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from jaxk3.kernels.kda_decode import Config, glue

    cfg, args = _kda_in_case(jnp.bfloat16, B, real=real)
    pos = jnp.asarray((np.arange(B) * 3 + 1) % 9, jnp.int32)
    ring = _as_ring(args[2], np.asarray(pos))
    if fused:
        name, at, rargs = "kda_decode_in", 2, (*args[:2], ring, *args[3:])
    else:
        u, f, beta, z = glue(cfg, args[0], args[1], args[2].dtype)
        name, at, rargs = "kda_decode", 1, (u, ring, args[3], f, beta, z, *args[4:])
    c = Config(bv=bv)
    ref = kernels.REGISTRY[name].reference(cfg, *rargs, pos_B=pos)
    fresh = [jnp.array(a, copy=True) if isinstance(a, jax.Array) else a for a in rargs]
    got = jax.jit(lambda *a: kernels.call(name, cfg, *a[:-1], mode="on", config=c, pos_B=a[-1]),
                  donate_argnums=(at,))(*fresh, pos)
    for i in (0, 2):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(ref[i]), rtol=0,
                                   atol=1e-4 * float(jnp.abs(ref[i]).max()))
    np.testing.assert_array_equal(np.asarray(got[1].astype(jnp.float32)), np.asarray(ref[1].astype(jnp.float32)))


# ------------------------------------------------------------------ mla_decode
# Tolerance of the mla_decode kernel against the float32 reference `latent_attention`, relative to
# max|ref|.  The kernel's only departure is the bf16 rounding of its dot operands q (q_latent, q_pe:
# once) and p (per block; the cache is bf16 as stored, the sums are fp32): each rounding is a relative
# error |e| <= u = 2^-8 on one factor of every product.  Summed over the R + P = 576 terms of a score
# the errors of random sign average out (the score moves by ~u/sqrt(3) of its rms, not by R·u), but
# those of q are the same for every slot, so they act as a query perturbed by q_r·e_r: the softmax
# tilts as for a query scaled by (1 + e_r) per channel, and the output moves by ~|e_r| of its own size,
# at most ~u.  p's rounding adds ~u/sqrt(3) per weight, averaged over the slots (~u/3 at these
# lengths).  Measured (numpy emulation of these roundings, 64 draws at the real shapes R 512, P 64,
# 4K context, scale 0.07, unit-normal q and cache): 0.4-1.3 u, q's part up to 1.06 u, p's 0.33 u; in
# interpret mode here 0.2-0.65 u.  MLA_TOL = 1e-2 ≈ 2.6 u.  The bugs this must catch are larger or
# not finite (measured by mutating the kernel, on the interpret cases below): a load past the
# length reads NaN (those slots are poisoned); a missed k_pe term 5e-2 to 0.5 of max|ref|, equal part
# weights in the merge 3e-2 to 0.19, a lost rescale of acc 3e-2 to 1.4, the row's last slot left out
# 9e-2 (or NaN where that leaves a row no slot).
MLA_TOL = 1e-2


def _mla_case(B: int, H: int, S: int, R: int, P: int, lengths, seed: int = 0):
    """Unit-normal q and bf16 cache; the cache again with every slot past a row's length set to NaN."""
    r = np.random.default_rng(seed + 31 * B + H + S)
    ql = jnp.asarray(r.standard_normal((B, H, R)), jnp.float32)
    qpe = jnp.asarray(r.standard_normal((B, H, P)), jnp.float32)
    kv = r.standard_normal((B, S, R + P)).astype(np.float32)
    poisoned = kv.copy()
    for b, n in enumerate(lengths):
        poisoned[b, n + 1:] = np.nan
    return ql, qpe, jnp.asarray(kv, jnp.bfloat16), jnp.asarray(poisoned, jnp.bfloat16), jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("B,H,S,R,P,lengths,tile", [
    (1, 16, 64, 64, 16, [63], {}),  # the whole cache, one head group
    (3, 3, 256, 64, 16, [0, 31, 130], {}),  # one slot, a block's last slot, ragged; 3 heads padded to 16
    (8, 20, 256, 64, 16, [255, 0, 32, 33, 100, 5, 200, 63], {}),  # two head groups (20 -> 32), block edges
    (3, 16, 2048, 512, 64, [2047, 777, 40], dict(split=1024, block_s=64)),  # real R, P; 2 parts of 16 steps
    (1, 32, 512, 64, 16, [300], dict(block_h=32, split=128)),  # a 32-head group, 4 parts
    (8, 20, 256, 64, 16, [255, 0, 32, 33, 100, 5, 200, 63], dict(order="pg", split=64)),  # the grid's parts first
])
def test_mla_decode_kernel_matches_reference(B, H, S, R, P, lengths, tile):
    """Interpret mode against `latent_attention` (float32) on a cache whose slots past each row's length
    are NaN: nothing past the length may be read.  Ragged lengths from 1 slot to the whole cache, block
    and part edges, padded heads, B 1/3/8.  Tolerance: MLA_TOL (above)."""
    ql, qpe, kv, poisoned, length = _mla_case(B, H, S, R, P, lengths)
    k = kernels.REGISTRY["mla_decode"]
    assert k.fits(ql, qpe, poisoned, length, 0.07, **tile) is None
    got = np.asarray(k.device(ql, qpe, poisoned, length, 0.07, interpret=True, **tile))
    ref = np.asarray(k.reference(ql, qpe, kv, length, 0.07))
    assert got.shape == ref.shape == (B, H, R) and np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=MLA_TOL * np.abs(ref).max())


@pytest.mark.parametrize("B,H,S,R,P,lengths,tile,V", [
    (1, 16, 64, 64, 16, [63], {}, 32),  # one part
    (3, 20, 256, 64, 16, [0, 31, 130], dict(split=64), 64),  # 4 parts, two head groups (20 -> 32), ragged
    (1, 32, 512, 64, 16, [300], dict(block_h=32, split=32), 64),  # 16 parts: two chunks of 8 in the merge
    (2, 16, 384, 64, 16, [383, 40], dict(split=32), 32),  # 12 parts (not a power of two): three chunks of 4
    (1, 16, 192, 64, 16, [150], dict(split=64), 32),  # 3 parts: chunks of 1
    (3, 20, 256, 64, 16, [0, 31, 130], dict(split=32, order="pg", merge_pc=2, merge_stages=2), 64),  # 8 parts: 4 steps
    (1, 32, 512, 64, 16, [300], dict(block_h=32, split=32, merge_pc=16, merge_stages=3), 64),  # 16 parts in one step
    (3, 20, 256, 64, 16, [0, 31, 130], dict(split=64, merge_r=16), 64),  # the R-split merge: 4 shares of 16 columns
    (1, 32, 512, 64, 16, [300], dict(block_h=32, split=32, merge_r=64), 32),  # one share (rc = R), 16 parts at once
    (1, 16, 4096, 256, 16, [3000], dict(split=32), 32),  # 128 parts: the R-split merge by default, 2 shares of 128
])
def test_mla_decode_uv_matches_reference(B, H, S, R, P, lengths, tile, V):
    """The parts merged and W_UV applied in one kernel (interpret mode) against `latent_attention` then the fp32
    einsum with kv_b_proj's value rows (read in place from row v0 = 16 of each head's rows), on the NaN-poisoned
    cache.  Tolerance: MLA_TOL of the output (the attention's bf16 operands; the merge adds its parts in another
    order, ~1e-7); the value rows taken from the wrong offset (the key rows) move it far outside."""
    ql, qpe, kv, poisoned, length = _mla_case(B, H, S, R, P, lengths)
    v0 = 16
    wkvb = jnp.asarray(np.random.default_rng(5).standard_normal((H, v0 + V, R)) * R ** -0.5, jnp.bfloat16)
    k = kernels.REGISTRY["mla_decode_uv"]
    assert k.fits(ql, qpe, poisoned, length, 0.07, wkvb, v0, only_where_faster=False, **tile) is None
    got = np.asarray(k.device(ql, qpe, poisoned, length, 0.07, wkvb, v0, interpret=True, **tile))
    ref = np.asarray(k.reference(ql, qpe, kv, length, 0.07, wkvb, v0))
    assert got.shape == ref.shape == (B, H, V) and np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=MLA_TOL * np.abs(ref).max())
    wrong = np.asarray(k.reference(ql, qpe, kv, length, 0.07, wkvb[:, :V], 0))
    assert np.abs(wrong - ref).max() > 10 * MLA_TOL * np.abs(ref).max()
    assert "must divide V" in k.fits(ql, qpe, poisoned, length, 0.07, wkvb, v0 + 1, only_where_faster=False, **tile)
    assert "not measured" in k.fits(ql, qpe, poisoned, length, 0.07, wkvb, v0, **tile)
    from jaxk3.tools.bench_decode import load_config  # the 48B's MLA at B = 1, measured in the step: auto takes it
    c48, S = load_config("kimi-linear-48b"), jax.ShapeDtypeStruct
    H48, R48, P48, n48 = c48.num_attention_heads, c48.kv_lora_rank, c48.qk_rope_head_dim, c48.qk_nope_head_dim
    a48 = (S((1, H48, R48), jnp.float32), S((1, H48, P48), jnp.float32), S((1, 4096, R48 + P48), jnp.bfloat16),
           S((1,), jnp.int32))
    assert k.fits(*a48, 0.07, S((H48, n48 + c48.v_head_dim, R48), jnp.bfloat16), n48) is None


def test_mla_decode_fits_and_tiles():
    """`fits` names what does not suit the kernel; the default tiles give the dots M, N, K >= 16."""
    from jaxk3.kernels import mla_decode as M

    s = jax.ShapeDtypeStruct
    args = (s((1, 96, 512), jnp.float32), s((1, 96, 64), jnp.float32), s((1, 4096, 576), jnp.bfloat16),
            s((1,), jnp.int32))
    assert M.fits(*args, 0.07) is None
    assert "bf16 cache" in M.fits(*args[:2], s((1, 4096, 576), jnp.float32), args[3], 0.07)
    assert "kv_lora_rank a power of two" in M.fits(s((1, 96, 384), jnp.float32), args[1],
                                                   s((1, 4096, 448), jnp.bfloat16), args[3], 0.07)
    assert "tl.dot" in M.fits(*args, 0.07, block_s=8)
    assert "shared memory" in M.fits(*args, 0.07, block_h=128, block_s=64, num_warps=16)
    assert "registers" in M.fits(*args, 0.07, block_h=64, num_warps=4)  # [64, 512] fp32 over 4 warps: 256 a thread
    assert M.fits(*args, 0.07, block_h=64) is None  # by default as many warps as keep it to half of ACC_REGS: 16
    assert (M.warps(16, 512), M.warps(32, 512), M.warps(64, 512), M.warps(32, 512, 4)) == (4, 8, 16, 4)
    assert M.fits(*args, 0.07, block_h=64, num_warps=8) is None
    assert "multiple of the split" in M.fits(*args[:2], s((1, 4000, 576), jnp.bfloat16), args[3], 0.07)
    assert "order must be" in M.fits(*args, 0.07, order="hg")
    w, v0 = s((96, 256, 512), jnp.bfloat16), 128  # the merge kernel's own settings: mla_decode_uv's conditions
    assert M.uv_fits(*args, 0.07, w, v0, only_where_faster=False) is None
    assert "merge_pc must be" in M.uv_fits(*args, 0.07, w, v0, merge_pc=12, only_where_faster=False)
    assert "merge_stages must be" in M.uv_fits(*args, 0.07, w, v0, merge_stages=0, only_where_faster=False)
    assert "takes no merge_pc" in M.fits(*args, 0.07, merge_pc=8)  # mla_decode's kernel would not take it
    assert "takes no merge_pc" in M.fits(*args, 0.07, merge_r=128)
    # the R-split merge by default from MERGE_R_MIN_PARTS parts (the 48B at 32K, B = 1: 128 parts; at 4K 64 parts, at
    # 32K B = 8 32 parts: the value-row form), where its tiles can run; an explicit merge_r as given
    assert M.merge_columns(128, 512, 128) == M.MERGE_R == 128 and M.merge_columns(64, 512, 128) == 0
    assert M.merge_columns(32, 512, 128) == 0 and M.merge_columns(128, 64, 32) == 64
    assert M.merge_columns(128, 256, 32) == 128  # the interpret case above: two shares
    assert "registers" in M.uv_fits(*args[:2], s((1, 32768, 576), jnp.bfloat16), args[3], 0.07, w, v0, merge_r=256,
                                    only_where_faster=False)  # 64 parts at 32K (96 heads): (64 + 128) x 256 / 256
    assert M.merge_columns(192, 512, 128) == 0 and M.merge_columns(256, 512, 128) == 64  # not a power of two; halved
    assert M.merge_columns(4096, 512, 128) == 0  # [4096, 16] tiles: over half of ACC_REGS even at 16 columns
    assert M.merge_columns(64, 512, 128, merge_r=64) == 64 and M.merge_columns(128, 512, 128, merge_r=0) == 0
    assert M.tiles(1, 32, 32768, 512, 64)[2] == 256 and M.tiles(1, 32, 4096, 512, 64)[2] == 64
    assert M.uv_fits(*args, 0.07, w, v0, merge_r=128, only_where_faster=False) is None  # 64 parts, [128, 128] tiles
    assert "merge_r must be" in M.uv_fits(*args, 0.07, w, v0, merge_r=96, only_where_faster=False)
    assert "registers" in M.uv_fits(*args, 0.07, w, v0, merge_r=512, only_where_faster=False)  # [128, 512] tiles
    assert "powers of two" in M.uv_fits(*args[:2], s((1, 3072, 576), jnp.bfloat16), args[3], 0.07, w, v0, merge_r=128,
                                        only_where_faster=False)  # 48 parts of 64 slots
    # the fp32 formula reproduces the 442,624 B measured for the first 64 x 64 fp32 tiling; bf16 halves it
    assert M.smem_estimate(64, 64, 512, 64, itemsize=4) == 442_624
    assert M.smem_estimate(16, 32, 512, 64) == 89_344
    # the split halves until >= 256 programs (~2 per SM), down to two blocks a part
    assert M.tiles(1, 32, 32768, 512, 64) == (16, 32, 256)  # Kimi-Linear at 32K: 2 groups x 128 parts
    assert M.tiles(8, 32, 4096, 512, 64) == (16, 32, 256)  # 8 x 2 x 16 = 256 (264 halved once more: slower)
    assert M.tiles(8, 32, 32768, 512, 64) == (16, 32, 1024)
    assert M.tiles(1, 96, 4096, 512, 64) == (16, 32, 64)  # 6 groups x 64 parts = 384 programs
    assert M.tiles(8, 96, 4096, 512, 64) == (16, 32, 512)  # 8 x 6 x 8 = 384
    assert M.tiles(1, 12, 4096, 512, 64) == (16, 32, 64)  # 64 programs: the floor of two blocks a part


@pytest.mark.gpu
def test_mla_decode_kernel_on_gpu():
    """Compiled (Triton, bf16 tensor-core dots) against the reference at full float32 precision (not
    TF32) at K3's TP 2 heads, 4K context, slots past the lengths poisoned.  Tolerance: MLA_TOL."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    ql, qpe, kv, poisoned, length = _mla_case(2, 48, 4096, 512, 64, [4095, 777])
    got = jax.jit(lambda *a: kernels.call("mla_decode", *a, 0.07, mode="on"))(ql, qpe, poisoned, length)
    with jax.default_matmul_precision("highest"):
        ref = kernels.REGISTRY["mla_decode"].reference(ql, qpe, kv, length, 0.07)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=MLA_TOL * float(jnp.abs(ref).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,lengths,tile", [
    (1, 4096, [4095], {}), (8, 4096, [4095, 777, 2048, 5, 4000, 1, 3000, 1234], {}),
    (1, 32768, [32767], {}), (8, 32768, [32767, 777, 20480, 5, 32000, 1, 3000, 12345], {}),  # 32K: the default split
    (1, 32768, [20000], dict(order="pg", split=1024, merge_pc=16, merge_stages=2)),  # the other grid order, pipelined
    (8, 4096, [4095, 777, 2048, 5, 4000, 1, 3000, 1234], dict(order="pg", split=512, merge_stages=3)),
    (1, 4096, [4095], dict(merge_r=128)), (1, 4096, [2000], dict(merge_r=64)),  # the R-split merge at the 48B's B = 1
    (8, 4096, [4095, 777, 2048, 5, 4000, 1, 3000, 1234], dict(merge_r=128)),
    (1, 32768, [32767], dict(block_h=32)), (1, 4096, [3000], dict(block_h=32)),  # one head group of 32, 8 warps
])
def test_mla_decode_uv_on_gpu(B, S, lengths, tile):
    """Compiled at Kimi-Linear-48B's MLA (32 heads, R 512, P 64, 4K and 32K context, W_UV rows 128: of each head's
    256), the default tiles and others of scripts/gpu/mla_sweep.py's, against the reference at full float32 precision,
    slots past the lengths poisoned.  Tolerance: MLA_TOL."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    ql, qpe, kv, poisoned, length = _mla_case(B, 32, S, 512, 64, lengths)
    wkvb = jnp.asarray(np.random.default_rng(5).standard_normal((32, 256, 512)) * 512 ** -0.5, jnp.bfloat16)
    assert kernels.REGISTRY["mla_decode_uv"].fits(ql, qpe, poisoned, length, 0.07, wkvb, 128,
                                                  only_where_faster=False, **tile) is None
    got = jax.jit(lambda *a: kernels.call("mla_decode_uv", *a[:4], 0.07, a[4], 128, mode="on", **tile))(
        ql, qpe, poisoned, length, wkvb)
    with jax.default_matmul_precision("highest"):
        ref = kernels.REGISTRY["mla_decode_uv"].reference(ql, qpe, kv, length, 0.07, wkvb, 128)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=MLA_TOL * float(jnp.abs(ref).max()))



# ------------------------------------------------------------------ mla_prep
def _prep_case(B: int, H: int, n: int, v: int, R: int, P: int, S: int, q_off: int, kv_off: int, lengths, valid,
               seed: int = 0):
    """A serving-layout GEMV output y (fp32, the latent at kv_off, the query at q_off, a few columns past both),
    kv_b_proj's rows [H, n + v, R] (bf16), the kv_a norm's weight and a bf16 cache of random values."""
    r = np.random.default_rng(seed + 7 * B + H)
    width = max(q_off + H * (n + P), kv_off + R + P + (H * (n + P) if kv_off else 0)) + 5  # kv_off > 0: q after it
    y = jnp.asarray(r.standard_normal((B, width)) * 2, jnp.float32)
    w = jnp.asarray(r.standard_normal((H, n + v, R)) * n ** -0.5, jnp.bfloat16)
    nw = jnp.asarray(1 + 0.1 * r.standard_normal(R), jnp.float32)
    kv = jnp.asarray(r.standard_normal((B, S, R + P)), jnp.bfloat16)
    return y, w, nw, kv, jnp.asarray(lengths, jnp.int32), jnp.asarray(valid, bool)


def _prep_agree(got, ref) -> None:
    """mla_prep's outputs against the reference with ql in bf16: ql to one bf16 step (2^-7 of max|ql|), q_pe bitwise,
    the cache to one bf16 rounding of the new entry (its norm's sum in another order)."""
    got, ref = ([np.asarray(a, np.float32) for a in x] for x in (got, ref))
    np.testing.assert_allclose(got[0], ref[0], rtol=0, atol=2 ** -7 * np.abs(ref[0]).max())
    np.testing.assert_array_equal(got[1], ref[1])
    np.testing.assert_allclose(got[2], ref[2], rtol=2 ** -7, atol=0)


def _prep_interpret(args) -> None:
    """mla_prep in interpret mode (bf16 ql) agrees with its reference (`_prep_agree`)."""
    k = kernels.REGISTRY["mla_prep"]
    assert k.fits(*args, only_where_faster=False) is None
    _prep_agree(k.device(*args, out_dtype=jnp.bfloat16, interpret=True), k.reference(*args, out_dtype=jnp.bfloat16))


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("B,H,n,v,R,P,S,q_off,kv_off,lengths,valid,config", [
    (1, 32, 128, 128, 512, 64, 64, 576, 0, [10], [True], None),  # Kimi-Linear-48B's MLA: [c_kv | k_pe | q] rows
    (3, 4, 32, 16, 64, 16, 32, 80, 0, [0, 31, 40], [True, False, True], None),  # a pad row; a length past the cache
    (2, 3, 64, 32, 128, 32, 16, 0, 7, [5, 15], [True, True], dict(br=32, bk=16)),  # K3's order: q apart, ckv at 7
    (1, 32, 128, 128, 512, 64, 64, 576, 0, [63], [True], dict(once=False)),  # each chunk reduced as it comes
])
def test_mla_prep_matches_reference(B, H, n, v, R, P, S, q_off, kv_off, lengths, valid, config, out_dtype):
    """Interpret mode against the MLA layer's own math (`reference`).  q_pe and the cache are casts and copies: equal
    bitwise (the entry's norm sums in another order: exact here, and allowed one bf16 rounding of the entry, 2^-7 of
    it); ql sums W_UK's products in another order: float32 rounding (1e-5 of max|ql|), or after its bf16 rounding one
    bf16 step (2^-7 relative).  Every cache slot but the valid rows' new one stays as it was (a pad row's too); the
    query read from the wrong offset moves ql far outside the bound."""
    from jaxk3.kernels import mla_prep as M

    y, w, nw, kv, length, ok = _prep_case(B, H, n, v, R, P, S, q_off, kv_off, lengths, valid)
    c = M.Config(**config) if config else None
    q_src = y if kv_off == 0 else y[:, kv_off + R + P:]  # K3: the query from its own GEMV
    qo = q_off if kv_off == 0 else 0
    args = (q_src, qo, y, kv_off, w, n, nw, 1e-6, kv, length, ok, jnp.bfloat16)
    k = kernels.REGISTRY["mla_prep"]
    assert k.fits(*args, out_dtype=out_dtype, config=c, only_where_faster=False) is None
    got = [np.asarray(a, np.float32) for a in k.device(*args, out_dtype=out_dtype, config=c, interpret=True)]
    ref = [np.asarray(a, np.float32) for a in k.reference(*args, out_dtype=out_dtype)]
    assert [g.shape for g in got] == [(B, H, R), (B, H, P), (B, S, R + P)] == [r.shape for r in ref]
    tol = 1e-5 if out_dtype == jnp.float32 else 2 ** -7
    np.testing.assert_allclose(got[0], ref[0], rtol=0, atol=tol * np.abs(ref[0]).max())
    np.testing.assert_array_equal(got[1], ref[1])
    np.testing.assert_allclose(got[2], ref[2], rtol=2 ** -7, atol=0)
    before = np.asarray(kv, np.float32)
    changed = np.argwhere((got[2] != before).any(-1))
    slots = {(b, min(L, S - 1)) for b, (L, o) in enumerate(zip(lengths, valid)) if o}
    assert {tuple(x) for x in changed} <= slots and len(changed) == len(slots)
    shifted = (q_src, qo + 1) + args[2:]
    wrong = np.asarray(k.reference(*shifted, out_dtype=jnp.float32)[0])
    assert np.abs(wrong - ref[0]).max() > 100 * tol * np.abs(ref[0]).max()


def _partial_sums(y, S: int):
    """S partial sums of unequal size [S, B, X] made from a GEMV output y [B, X], as the GEMV's K splits leave them."""
    return jnp.stack([y * (0.5 + i) for i in range(S)]) / (S * (S + 1) / 2 if S > 1 else 1)


@pytest.mark.parametrize("S", [1, 3])
def test_mla_prep_adds_the_gemv_partial_sums(S):
    """`mla_prep.PARTIALS`: the sources are a GEMV's partial sums over its K splits [S, B, X] (the 48B's in_proj: 3),
    which the kernel adds as it reads them; the reference adds them first (XLA).  The bounds of
    test_mla_prep_matches_reference (the adds in the same order: q_pe and the cache agree bitwise here)."""
    y, w, nw, kv, length, ok = _prep_case(2, 32, 128, 128, 512, 64, 64, 576, 0, [10, 63], [True, True])
    p = _partial_sums(y, S)
    args = (p, 576, p, 0, w, 128, nw, 1e-6, kv, length, ok, jnp.bfloat16)
    _prep_interpret(args)
    ref = kernels.REGISTRY["mla_prep"].reference
    y2 = jnp.sum(p, 0)  # the reference's sum is the 2-D source's
    np.testing.assert_array_equal(np.asarray(ref(y2, 576, y2, 0, *args[4:])[1]), np.asarray(ref(*args)[1]))


@pytest.mark.parametrize("src", ["k3tp1", "k3tp2"])
def test_mla_prep_reads_k3s_sources(src):
    """K3's sources (interpret mode, 8 heads of K3's per-head dims): the latent after q_a's 1536 rows of the GEMV
    output and the query from q_b_proj's own output (TP 1), or the gathered bf16 latent (shard_latent at TP > 1);
    the bounds of test_mla_prep_matches_reference."""
    y, w, nw, kv, length, ok = _prep_case(2, 8, 128, 128, 512, 64, 32, 0, 1536, [3, 40], [True, True])
    q_src, qo, kv_src, ko = _prep_sources(y, 8, src, 1536, 0)
    _prep_interpret((q_src, qo, kv_src, ko, w, 128, nw, 1e-6, kv, length, ok, jnp.bfloat16))


def test_mla_prep_fits():
    """`fits` names what does not suit the kernel; auto takes it only at measured shapes."""
    from jaxk3.kernels import mla_prep as M

    s = jax.ShapeDtypeStruct
    args = (s((1, 6720), jnp.float32), 576, s((1, 6720), jnp.float32), 0, s((32, 256, 512), jnp.bfloat16), 128,
            s((512,), jnp.float32), 1e-6, s((1, 4096, 576), jnp.bfloat16), s((1,), jnp.int32), s((1,), bool),
            jnp.bfloat16)
    assert M.fits(*args) is None  # the 48B's MLA at B = 1: measured in the step, auto takes it
    b8 = tuple(s((8,) + a.shape[1:], a.dtype) if i in (0, 2, 8, 9, 10) else a for i, a in enumerate(args))
    assert "was not measured" in M.fits(*b8) and M.fits(*b8, only_where_faster=False) is None
    assert "query's source must be" in M.fits(s((1, 6000), jnp.float32), *args[1:], only_where_faster=False)
    assert "latent's source must be" in M.fits(*args[:2], s((1, 500), jnp.float32), *args[3:], only_where_faster=False)
    assert "qk_rope_head_dim a power of two" in M.fits(*args[:8], s((1, 4096, 560), jnp.bfloat16), *args[9:],
                                                       only_where_faster=False)
    assert "first n < X rows" in M.fits(*args[:5], 256, *args[6:], only_where_faster=False)
    assert "kv_a_layernorm must be" in M.fits(*args[:6], s((576,), jnp.float32), *args[7:], only_where_faster=False)
    assert "Config.br a power of two" in M.fits(*args, config=M.Config(br=96), only_where_faster=False)


def _prep_sources(y, H: int, src: str, kv_off: int, q_off: int):
    """(q_src, q_off, kv_src, kv_off) as the MLA layer hands them: "fused" the serving layout's one GEMV output at two
    offsets; "k3tp1" the latent after q_a's rows of that output, the query from q_b_proj's own; "k3tp2" (shard_latent
    at TP > 1) the gathered latent in the activation dtype (bf16) and the query from q_b_proj."""
    if src == "fused":
        return y, q_off, y, kv_off
    if src == "partials":  # `PARTIALS`: the GEMV's three K splits' partial sums [3, B, X]
        p = _partial_sums(y, 3)
        return p, q_off, p, kv_off
    q = y[:, kv_off + 576:kv_off + 576 + H * 192]
    if src == "k3tp1":
        return q, 0, y, kv_off
    return q, 0, y[:, kv_off:kv_off + 576].astype(jnp.bfloat16), 0


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,src,lengths,valid", [
    (1, 32, "fused", [4095], [True]),  # Kimi-Linear-48B: [c_kv | k_pe | q] rows of one GEMV output
    (8, 32, "fused", [4095, 777, 2048, 5, 4000, 1, 3000, 0], [True] * 6 + [False, True]),
    (1, 96, "k3tp1", [2047], [True]),  # K3 at TP 1: the latent after q_a's 1536 rows, the query from q_b_proj
    (1, 48, "k3tp2", [300], [True]),  # K3 at TP 2: the gathered bf16 latent, the query from q_b_proj
    (1, 32, "partials", [4095], [True]),  # the 48B's in_proj as its three K splits' partial sums (`PARTIALS`)
])
def test_mla_prep_on_gpu(B, H, src, lengths, valid):
    """Compiled at the presets' MLA (n 128, v 128, R 512, P 64; Kimi-Linear-48B's 32 heads, K3's 96 and 48 per rank),
    a 4K cache, against the reference at full float32 precision: the bounds of the interpret test (ql to one bf16 step
    as the attention kernel takes it, q_pe bitwise, the entry to one bf16 rounding, every other slot kept)."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    kv_off = 1536 if src.startswith("k3") else 0
    y, w, nw, kv, length, ok = _prep_case(B, H, 128, 128, 512, 64, 4096, 0 if src.startswith("k3") else 576, kv_off,
                                          lengths, valid)
    q_src, qo, kv_src, ko = _prep_sources(y, H, src, kv_off, 576)
    args = (q_src, qo, kv_src, ko, w, 128, nw, 1e-6, kv, length, ok, jnp.bfloat16)
    before = np.asarray(kv, np.float32)
    got = jax.jit(lambda *a: kernels.call("mla_prep", *a, out_dtype=jnp.bfloat16, mode="on"),
                  static_argnums=(1, 3, 5, 7, 11))(*args)
    with jax.default_matmul_precision("highest"):
        ref = kernels.REGISTRY["mla_prep"].reference(*args, out_dtype=jnp.bfloat16)
    _prep_agree(got, ref)
    changed = {tuple(x) for x in np.argwhere((np.asarray(got[2], np.float32) != before).any(-1))}
    assert changed == {(b, min(L, 4095)) for b, (L, o) in enumerate(zip(lengths, valid)) if o}


# ------------------------------------------------------------------ kda_prefill
def _kda_prefill_case(B: int, H: int, T: int, K: int, V: int, gate: float, seed: int = 0):
    """q scaled as the layer scales it, unit-norm k, gates -|N(0,1)|·gate, a random incoming state."""
    r = np.random.default_rng(seed + T + K)
    k = r.standard_normal((B, H, T, K))
    args = (r.standard_normal((B, H, T, K)) * K ** -0.5, k / np.linalg.norm(k, axis=-1, keepdims=True),
            r.standard_normal((B, H, T, V)), -np.abs(r.standard_normal((B, H, T, K))) * gate,
            r.uniform(0, 1, (B, H, T)), r.standard_normal((B, H, K, V)))
    return tuple(jnp.asarray(a, jnp.float32) for a in args)


# the first case is slow (the newest-jax suite leaves it to the first): the second takes the same paths
# (several chunks of several sub-chunks, two value blocks) with the strong gates
@pytest.mark.parametrize("T,chunk,gate,block_v", [pytest.param(128, 64, 0.3, 16, marks=pytest.mark.slow),
                                                  (96, 32, 20.0, 32)])
def test_kda_prefill_kernel_matches_reference(T, chunk, gate, block_v):
    """Interpret mode (every chunk's operands at once, then the state pass kernel) against the per-chunk
    scan form: two chunks of four sub-chunks, three of two with gates of -20 per step (an e^{-Γ} taken
    alone would overflow fp32), value columns over two programs.  Tolerance 2e-5 of
    max|ref|: the same fp32 products in another order (the two forms agree with a float64 recurrence
    within 5e-6, tests/test_layers.py); a lost state carry or decay moves the output by >= 1e-2 of it."""
    from jaxk3.kernels import kda_prefill as KP

    args = _kda_prefill_case(2, 3, T, 16, 32, gate)
    c = KP.Config(block_v=block_v)
    assert KP.fits(*args, chunk=chunk, config=c) is None
    o, S = KP.chunked(*args, chunk=chunk, config=c, interpret=True)
    o_ref, S_ref = KP.chunk_delta_rule(*args, chunk=chunk)
    for got, ref in ((o, o_ref), (S, S_ref)):
        got, ref = np.asarray(got), np.asarray(ref)
        assert got.shape == ref.shape and np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    # the kernel alone against its jnp form (a scan over the same operands)
    ops = KP.chunk_operands(*args[:5], chunk)
    for got, ref in zip(KP.state_pass(ops, args[5], c, interpret=True), KP.state_pass_reference(ops, args[5])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=1e-5 * float(jnp.abs(ref).max()))


def test_kda_prefill_fits_and_selection():
    """`fits` names the dims and tiles that do not suit; proven, so auto takes the kernel on GPUs (the scan on CPUs)."""
    from jaxk3.kernels import kda_prefill as KP

    s = jax.ShapeDtypeStruct
    q, v, b, st = s((1, 32, 4096, 128), jnp.float32), s((1, 32, 4096, 128), jnp.float32), s((1, 32, 4096), jnp.float32), \
        s((1, 32, 128, 128), jnp.float32)
    assert KP.fits(q, q, v, q, b, st) is None
    assert "a multiple of the chunk 64" in KP.fits(*(s((1, 32, 4000, 128), jnp.float32),) * 4, b, st)
    assert "value head dim a power of two" in KP.fits(q, q, s((1, 32, 4096, 96), jnp.float32), q, b, st)
    assert "block_v 64 must divide" in KP.fits(q, q, s((1, 32, 4096, 32), jnp.float32), q, b, st,
                                               config=KP.Config(block_v=64))
    assert "precision must be" in KP.fits(q, q, v, q, b, st, config=KP.Config(precision="bf16"))
    assert "does not fit shared memory" in KP.fits(q, q, v, q, b, st, config=KP.Config(block_v=64))
    assert kernels.explain("kda_prefill", q, q, v, q, b, st, platform="gpu").startswith("device")
    assert kernels.explain("kda_prefill", q, q, v, q, b, st, platform="cpu").startswith("reference")


@pytest.mark.gpu
@pytest.mark.parametrize("block_v,precision", [(32, "tf32x3"), (16, "tf32x3"), (32, "ieee")])
def test_kda_prefill_kernel_on_gpu(block_v, precision):
    """Compiled (Triton; the state pass's dots IEEE fp32 or TF32x3) at Kimi-Linear-48B's 32 heads x 128 x 128,
    512 tokens in chunks of 64, against the scan form at full float32 precision.  Tolerance 1e-4 of max|ref|
    (fp32 over 8 chunks of carried state; a single TF32 product anywhere would show as ~1e-3)."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from jaxk3.kernels import kda_prefill as KP

    args = _kda_prefill_case(1, 32, 512, 128, 128, 0.3)
    c = KP.Config(block_v=block_v, precision=precision)
    got = jax.jit(lambda *a: KP.chunked(*a, chunk=64, config=c))(*args)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda *a: KP.chunk_delta_rule(*a, chunk=64))(*args)
    for g, r in zip(got, ref):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=1e-4 * float(jnp.abs(r).max()))


# ------------------------------------------------------------------ mla_prefill
def _mla_prefill_case(B: int, T: int, H: int, S: int, R: int, P: int, prefix, pads, seed: int = 0):
    """Row b: `prefix[b]` cached slots, then T tokens of which the first pads[b] are left padding (they
    see slot 0 or the prefix's last, as mla_prefill's limits do); every slot past a row's last token
    is NaN in the poisoned cache."""
    r = np.random.default_rng(seed + 7 * B + T + H)
    ql = jnp.asarray(r.standard_normal((B, T, H, R)), jnp.float32)
    qpe = jnp.asarray(r.standard_normal((B, T, H, P)), jnp.float32)
    kv = r.standard_normal((B, S, R + P)).astype(np.float32)
    limit = np.zeros((B, T), np.int32)
    poisoned = kv.copy()
    for b, (n, z) in enumerate(zip(prefix, pads)):
        limit[b] = np.maximum(n + np.cumsum(np.arange(T) >= z) - 1, 0)
        poisoned[b, limit[b].max() + 1:] = np.nan
    return (ql, qpe, jnp.asarray(kv, jnp.bfloat16), jnp.asarray(poisoned, jnp.bfloat16), jnp.asarray(limit))


# slow (the newest-jax suite leaves them to the first): test_mla_prefill_attention_forms[absorbed] takes the
# same kernel's every path (prefixes, pads, poisoned slots, rows over token edges) on that jax
@pytest.mark.parametrize("B,T,H,S,R,P,prefix,pads,config", [
    pytest.param(1, 8, 16, 64, 64, 16, [0], [0], dict(bm=16, bn=16), marks=pytest.mark.slow),  # a fresh prompt
    pytest.param(3, 16, 3, 128, 64, 16, [0, 40, 100], [0, 5, 15], dict(bm=32, bn=32),  # prefixes, left pads,
                 marks=pytest.mark.slow),  # rows over token edges (3 heads)
    pytest.param(2, 32, 8, 256, 512, 64, [200, 0], [3, 0], dict(bm=64, bn=32, num_warps=8),  # real latent widths
                 marks=pytest.mark.slow),
])
def test_mla_prefill_kernel_matches_reference(B, T, H, S, R, P, prefix, pads, config):
    """The absorbed kernel in interpret mode against `latent_attention_prefill` (float32) with every slot past
    a row's last token poisoned (NaN): nothing past it may be read.  Tolerance MLA_TOL: the same bf16
    roundings of q and p as mla_decode (above), over the same kind of sums."""
    from jaxk3.kernels import mla_prefill as M

    ql, qpe, kv, poisoned, limit = _mla_prefill_case(B, T, H, S, R, P, prefix, pads)
    got = np.asarray(M.mla_prefill(ql, qpe, poisoned, limit, 0.07, config=M.Config(**config), interpret=True))
    ref = np.asarray(M.latent_attention_prefill(ql, qpe, kv, limit, 0.07))
    assert got.shape == ref.shape == (B, T, H, R) and np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=MLA_TOL * np.abs(ref).max())


def _mla_heads_case(B, T, H, S, N, V, R, P, prefix, pads, seed: int = 0):
    """_mla_prefill_case's cache and limits with a no-rope query q_nope [B, T, H, N] and W_kvb [H, N + V, R]
    scaled so that scores and outputs are O(1)."""
    _, qpe, kv, poisoned, limit = _mla_prefill_case(B, T, H, S, R, P, prefix, pads, seed)
    r = np.random.default_rng(seed + 5)
    qn = jnp.asarray(r.standard_normal((B, T, H, N)), jnp.float32)
    wkvb = jnp.asarray(r.standard_normal((H, N + V, R)) * R ** -0.5, jnp.float32)
    return qn, qpe, kv, poisoned, limit, wkvb


@pytest.mark.parametrize("form,config", [("absorbed", dict(bm=16, bn=32)), ("heads", dict(bm=16, bn=32)),
                                         ("heads", dict(bm=32, bn=16))])
def test_mla_prefill_attention_forms(form, config):
    """The registered pair: `attention_device` (interpret mode) in both forms against `attention` (fp32, the
    layer's former inline math), prefixes, left pads, 3 heads, slots past each row's last token poisoned.
    Tolerance MLA_TOL: the per-head form rounds its expanded keys and values to bf16 once, as the absorbed
    form rounds its query (same size of error on the same kind of sums)."""
    from jaxk3.kernels import mla_prefill as M

    qn, qpe, kv, poisoned, limit, wkvb = _mla_heads_case(3, 16, 3, 128, 32, 16, 64, 16, [0, 40, 100], [0, 5, 15])
    c = M.Config(form=form, **config)
    assert M.fits(qn, qpe, poisoned, limit, wkvb, 0.07, config=c) is None
    got = np.asarray(M.attention_device(qn, qpe, poisoned, limit, wkvb, 0.07, config=c, interpret=True))
    ref = np.asarray(M.attention(qn, qpe, kv, limit, wkvb, 0.07))
    assert got.shape == ref.shape == (3, 16, 3, 16) and np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=MLA_TOL * np.abs(ref).max())


def test_mla_prefill_fits():
    """`fits` names the cache dtype, the widths of each form, tiles under tl.dot's minimum, shared memory and
    registers."""
    from jaxk3.kernels import mla_prefill as M

    s = jax.ShapeDtypeStruct
    qn, qpe, kv, lim = (s((1, 64, 32, 128), jnp.float32), s((1, 64, 32, 64), jnp.float32),
                        s((1, 4096, 576), jnp.bfloat16), s((1, 64), jnp.int32))
    wkvb = s((32, 256, 512), jnp.float32)
    assert M.fits(qn, qpe, kv, lim, wkvb, 0.07) is None
    assert M.fits(qn, qpe, kv, lim, wkvb, 0.07, config=M.Config(form="heads")) is None
    assert "bf16 cache" in M.fits(qn, qpe, s((1, 4096, 576), jnp.float32), lim, wkvb, 0.07)
    assert "kv_lora_rank a power of two" in M.fits(qn, qpe, s((1, 4096, 448), jnp.bfloat16), lim, wkvb, 0.07)
    assert "v_head_dim a power of two" in M.fits(qn, qpe, kv, lim, s((32, 224, 512), jnp.float32), 0.07,
                                                 config=M.Config(form="heads"))
    assert "form must be" in M.fits(qn, qpe, kv, lim, wkvb, 0.07, config=M.Config(form="mha"))
    assert "powers of two >= 16" in M.fits(qn, qpe, kv, lim, wkvb, 0.07, config=M.Config(bn=8))
    assert "shared memory" in M.fits(qn, qpe, kv, lim, wkvb, 0.07, config=M.Config(bm=128, bn=128, num_warps=16))
    assert "registers" in M.fits(qn, qpe, kv, lim, wkvb, 0.07, config=M.Config(bm=64, num_warps=4))


def test_mla_prefill_chooses_the_heads_form_where_the_chunk_is_much_of_the_cache(monkeypatch):
    """Without a config, `attention_device` and `fits` take `choose`'s: the per-head form (HEADS) where S <= 8·T, the
    expanded keys and values fit their budget and the per-head widths suit it (it was measured faster at S = T and
    S = 4T; a cache rounds up), the absorbed form's defaults elsewhere and with HEADS_MAX_RATIO = 0; interpret mode
    agrees with the reference either way (tolerance MLA_TOL, as test_mla_prefill_attention_forms)."""
    from jaxk3.kernels import mla_prefill as M

    s = jax.ShapeDtypeStruct
    w48 = s((32, 256, 512), jnp.bfloat16)
    q = lambda B, T: s((B, T, 32, 128), jnp.float32)  # noqa: E731
    pe = lambda B, T: s((B, T, 32, 64), jnp.float32)  # noqa: E731
    kv = lambda B, S: s((B, S, 576), jnp.bfloat16)  # noqa: E731
    assert M.choose(q(1, 4096), pe(1, 4096), kv(1, 4096), w48) == M.HEADS
    assert M.choose(q(8, 1024), pe(8, 1024), kv(8, 4096), w48) == M.HEADS
    assert M.choose(q(8, 1024), pe(8, 1024), kv(8, 4608), w48) == M.HEADS  # 3072 + 1024 + new tokens, rounded up
    assert M.choose(q(1, 512), pe(1, 512), kv(1, 8192), w48) == M.Config()  # S = 16T: the expansion would dominate
    assert M.choose(q(8, 4096), pe(8, 4096), kv(8, 16384), w48) == M.Config()  # 4 GiB of fp32 keys and values
    w_odd = s((32, 128 + 96, 512), jnp.bfloat16)  # V = 96: not a power of two, so only the absorbed form fits
    assert M.choose(q(1, 4096), pe(1, 4096), kv(1, 4096), w_odd) == M.Config()
    assert M.fits(q(1, 4096), pe(1, 4096), kv(1, 4096), s((1, 4096), jnp.int32), w_odd, 0.07) is None
    monkeypatch.setattr(M, "HEADS_MAX_RATIO", 0)
    assert M.choose(q(1, 4096), pe(1, 4096), kv(1, 4096), w48) == M.Config()
    monkeypatch.setattr(M, "HEADS_MAX_RATIO", 8)
    qn, qpe, kvc, poisoned, limit, wkvb = _mla_heads_case(2, 32, 3, 64, 32, 16, 64, 16, [0, 20], [0, 5])
    monkeypatch.setattr(M, "HEADS", M.Config(bm=16, bn=16, form="heads"))  # tiles of the tiny dims
    assert M.choose(qn, qpe, poisoned, wkvb).form == "heads"
    assert M.fits(qn, qpe, poisoned, limit, wkvb, 0.07) is None
    got = np.asarray(M.attention_device(qn, qpe, poisoned, limit, wkvb, 0.07, interpret=True))
    ref = np.asarray(M.attention(qn, qpe, kvc, limit, wkvb, 0.07))
    np.testing.assert_allclose(got, ref, rtol=0, atol=MLA_TOL * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("config", [dict(), dict(bm=32, bn=32, num_warps=4), dict(bm=64, bn=32, num_warps=8),
                                    dict(form="heads"), dict(form="heads", bm=64, bn=64),
                                    dict(form="heads", bm=64, bn=32, num_stages=3)])
def test_mla_prefill_kernel_on_gpu(config):
    """Compiled (Triton), both forms, against the reference at full float32 precision at Kimi-Linear-48B's
    32 heads, 128 nope / 128 v / 512 + 64 latent, a 256-token chunk after a 700-slot prefix and one fresh
    row with pads; slots past each row's last token poisoned.  Tolerance: MLA_TOL."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from jaxk3.kernels import mla_prefill as M

    qn, qpe, kv, poisoned, limit, wkvb = _mla_heads_case(2, 256, 32, 1024, 128, 128, 512, 64, [700, 0], [0, 9])
    c = M.Config(**config)
    got = jax.jit(lambda *a: M.attention_device(*a, 0.07, config=c))(qn, qpe, poisoned, limit, wkvb)
    with jax.default_matmul_precision("highest"):
        ref = M.attention(qn, qpe, kv, limit, wkvb, 0.07)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=MLA_TOL * float(jnp.abs(ref).max()))


# ------------------------------------------------------------------ router_topk
@pytest.mark.parametrize("which", ["tiny_k3", "tiny_kimi_linear", "k3"])
@pytest.mark.parametrize("B", [1, 5])
def test_router_topk_kernel_matches_reference(which, B):
    """Interpret mode against `moe.select_experts`: ids equal (order included), weights within 1e-6
    relative (the same float32 terms; only the k-term renormalising sum may be added in another
    order).  Row 0 holds ties (equal logits): the lowest index goes first, as lax.top_k does."""
    import dataclasses

    from jaxk3.config import KimiK3Config

    cfg = getattr(KimiK3Config, which)()
    if which == "tiny_kimi_linear":
        cfg = dataclasses.replace(cfg, routed_scaling_factor=2.5, moe_renormalize=False)
    E = cfg.num_experts
    r = np.random.default_rng(B + E)
    logits = r.standard_normal((B, E)).astype(np.float32)
    logits[0, 3:3 + 2 * cfg.num_experts_per_token] = 0.75  # ties across the top-k boundary
    bias = jnp.asarray(np.where(np.arange(E) % 5 == 0, 0.0, 0.01 * r.standard_normal(E)), jnp.float32)
    if which == "k3":
        bias = jnp.zeros(E, jnp.float32)  # ties stay ties with a zero bias
    k = kernels.REGISTRY["router_topk"]
    assert k.fits(cfg, jnp.asarray(logits), bias, only_where_faster=False) is None
    w, ids = k.device(cfg, jnp.asarray(logits), bias, interpret=True)
    rw, rids = k.reference(cfg, jnp.asarray(logits), bias)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(rw), rtol=1e-6)
    # the form that also norms the experts' input (rows of very different scale; D = 96: three parts of 32)
    x = jnp.asarray(r.standard_normal((B, 96)) * 10.0 ** r.uniform(-2, 2, (B, 1)), jnp.bfloat16)
    g = jnp.asarray(r.uniform(0.5, 1.5, 96), jnp.bfloat16)
    assert k.fits(cfg, jnp.asarray(logits), bias, x_BD=x, norm_w=g, eps=1e-5, only_where_faster=False) is None
    w2, ids2, xn = k.device(cfg, jnp.asarray(logits), bias, x_BD=x, norm_w=g, eps=1e-5, interpret=True)
    rw2, rids2, rxn = k.reference(cfg, jnp.asarray(logits), bias, x_BD=x, norm_w=g, eps=1e-5)
    np.testing.assert_array_equal(np.asarray(ids2), np.asarray(rids))
    np.testing.assert_allclose(np.asarray(w2), np.asarray(rw), rtol=1e-6)
    assert xn.dtype == x.dtype and xn.shape == x.shape
    # the sum of squares in another order: at most one bf16 rounding apart (2^-8 relative)
    np.testing.assert_allclose(np.asarray(xn, np.float32), np.asarray(rxn, np.float32), rtol=2 ** -7, atol=0)
    assert np.mean(np.asarray(xn) == np.asarray(rxn)) > 0.9
    assert "norm weight [D]" in k.fits(cfg, jnp.asarray(logits), bias, x_BD=x, norm_w=g[:-1], only_where_faster=False)
    assert "made the 48B step's MoE block slower" in k.fits(cfg, jnp.asarray(logits), bias, x_BD=x, norm_w=g)
    grouped = dataclasses.replace(KimiK3Config.tiny_k3(), num_expert_group=4, topk_group=2)
    assert "group-limited" in k.fits(grouped, jnp.asarray(logits[:, :16]), bias[:16], only_where_faster=False)


def test_router_topk_only_where_faster():
    """`auto` takes the router kernel only at the shapes where it beat XLA on the H200: K3 (896 experts,
    k 16: 1.30-1.36x) yes, Kimi-Linear (256, k 8: 0.56-0.65x) no, naming the numbers; unmeasured batch
    sizes (prefill) no.  only_where_faster=False runs it wherever it fits, also with kernels='on'."""
    from jaxk3.config import KimiK3Config
    from jaxk3.tools.bench_decode import load_config

    s = jax.ShapeDtypeStruct
    k3, kl = KimiK3Config.k3(), load_config("kimi-linear-48b")
    assert (kl.num_experts, kl.num_experts_per_token, k3.num_experts, k3.num_experts_per_token) == (256, 8, 896, 16)

    def args(cfg, B):
        return cfg, s((B, cfg.num_experts), jnp.float32), s((cfg.num_experts,), jnp.float32)
    k = kernels.REGISTRY["router_topk"]
    assert not k.unproven
    for B in (1, 3, 8):
        assert k.fits(*args(k3, B)) is None
        assert kernels.explain("router_topk", *args(k3, B), platform="gpu") == "device: router_topk on gpu"
        why = k.fits(*args(kl, B))
        assert "XLA is faster" in why and "256 experts, k 8" in why
        assert ("20.5 us" in why and "13.4 us" in why) if B == 1 else ("21.6 us" in why and "12.1 us" in why)
        assert kernels.explain("router_topk", *args(kl, B), platform="gpu").startswith("reference: router_topk kernel")
        assert k.fits(*args(kl, B), only_where_faster=False) is None
        assert kernels.explain("router_topk", *args(kl, B), platform="gpu", mode="on",
                               only_where_faster=False).startswith("device")
    assert "not measured" in k.fits(*args(k3, 64))  # prefill's token counts
    assert k.fits(*args(k3, 64), only_where_faster=False) is None
    # the reference takes (and ignores) the keyword, so kernels.call can pass it on every path
    cfg = KimiK3Config.tiny_k3()
    logits, bias = jnp.ones((2, cfg.num_experts)), jnp.zeros(cfg.num_experts)
    w, ids = kernels.call("router_topk", cfg, logits, bias, only_where_faster=False)
    rw, rids = k.reference(cfg, logits, bias)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))


@pytest.mark.gpu
def test_router_topk_kernel_on_gpu():
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from jaxk3.config import KimiK3Config

    cfg = KimiK3Config.k3()
    r = np.random.default_rng(0)
    logits = jnp.asarray(r.standard_normal((8, cfg.num_experts)), jnp.float32)
    bias = jnp.asarray(0.01 * r.standard_normal(cfg.num_experts), jnp.float32)
    assert kernels.explain("router_topk", cfg, logits, bias) == "device: router_topk on gpu"  # auto: K3 won
    w, ids = jax.jit(lambda a, b: kernels.call("router_topk", cfg, a, b, mode="on"))(logits, bias)
    rw, rids = kernels.REGISTRY["router_topk"].reference(cfg, logits, bias)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(rw), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
def test_router_topk_normed_on_gpu(B):
    """The form that norms the experts' input, compiled at Kimi-Linear-48B's router (256 experts, k 8, D 2304)."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from jaxk3.tools.bench_decode import load_config

    cfg = load_config("kimi-linear-48b")
    r = np.random.default_rng(B)
    E, D = cfg.num_experts, cfg.hidden_size
    logits = jnp.asarray(r.standard_normal((B, E)), jnp.float32)
    bias = jnp.asarray(0.01 * r.standard_normal(E), jnp.float32)
    x = jnp.asarray(30.0 * r.standard_normal((B, D)), jnp.bfloat16)
    g = jnp.asarray(r.uniform(0.5, 1.5, D), jnp.bfloat16)
    f = jax.jit(lambda a, b, x, g: kernels.call("router_topk", cfg, a, b, x_BD=x, norm_w=g, eps=1e-5, mode="on"))
    w, ids, xn = f(logits, bias, x, g)
    rw, rids, rxn = kernels.REGISTRY["router_topk"].reference(cfg, logits, bias, x_BD=x, norm_w=g, eps=1e-5)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(rw), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(xn, np.float32), np.asarray(rxn, np.float32), rtol=2 ** -7, atol=0)
    assert np.mean(np.asarray(xn) == np.asarray(rxn)) > 0.9


def test_status_says_what_auto_does(monkeypatch):
    """`kernels.status` (printed by `jaxk3 info`): on the CPU every kernel runs its reference; on a GPU
    the proven ones run on the device and the unproven ones say why not (none now: one marked unproven here)."""
    cpu, gpu = kernels.status("cpu"), kernels.status("gpu")
    assert set(cpu) == set(gpu) == set(kernels.REGISTRY)
    assert all(v.startswith("reference: no ") for v in cpu.values())
    # proven at real dims (docs/PERF.md); gemv and router_topk then only at the shapes where they won (`fits`)
    assert gpu["rms_norm"] == gpu["kda_decode"] == gpu["gemv"] == gpu["router_topk"] == gpu["mla_decode"] == "device"
    assert gpu["mla_prefill"] == gpu["kda_prefill"] == "device"
    assert gpu["moe_grouped"] == gpu["moe_experts"] == "device"
    assert gpu["gemv_norm"] == "device"
    assert gpu["kda_decode_in"] == gpu["moe_experts_routed"] == gpu["gemv_gnorm"] == gpu["mla_decode_uv"] == "device"
    assert gpu["mla_prep"] == "device"
    assert not [n for n, v in gpu.items() if v.startswith("reference: unproven")]
    assert set(kernels.REGISTRY) == {"gemv", "gemv_gnorm", "gemv_norm", "kda_decode", "kda_decode_in", "kda_prefill",
                                     "mla_decode", "mla_decode_uv", "mla_prefill", "mla_prep", "moe_experts",
                                     "moe_experts_routed", "moe_grouped", "rms_norm", "router_topk"}
    assert "1.23x XLA at Kimi-Linear-48B B=1" in kernels.speeds()["moe_experts"]
    from jaxk3.kernels import registry

    monkeypatch.setitem(registry.REGISTRY, "gemv_gnorm",
                        dataclasses.replace(registry.REGISTRY["gemv_gnorm"], unproven="not yet run on a GPU"))
    assert kernels.status("gpu")["gemv_gnorm"] == "reference: unproven on gpu (not yet run on a GPU)"
    assert kernels.active("gpu")["gemv_gnorm"] is False and kernels.active("gpu")["gemv_norm"] is True


def test_info_lists_the_kernels(capsys):
    import json

    from jaxk3 import cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "device kernels with kernels='auto'" in out and all(n in out for n in kernels.REGISTRY)
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kernels_auto"] == kernels.status("cpu")
    assert info["kernels_measured"] == kernels.speeds() and all(
        "x" in v or v == "not measured" for v in info["kernels_measured"].values())
    # the decode forms' switches, each naming a module constant that exists, on by default (timed faster)
    assert info["form_switches"] == {"jaxk3.kernels.attn_res_norm.SELECT_STACK": True,
                                     "jaxk3.layers.moe.LATENT_NORM_IN_UP": True, "jaxk3.kernels.mla_decode.MERGE_R": True}
    assert "attn_res_norm.SELECT_STACK=on" in out and "moe.LATENT_NORM_IN_UP=on" in out and "mla_decode.MERGE_R=on" in out



# ------------------------------------------------------------------ moe_experts' CUDA gate-up (one token, MXFP4)
def _mma_m16n8k16(a_regs, b_regs):
    """PTX mma.sync m16n8k16 (f16 in, f32 out) from its 32 lanes' fragment registers, as the PTX ISA lays them out:
    A[m][k] (row major, 16 x 16): lane (g, t) holds a0,a1 = A[g][2t, 2t+1], a2,a3 = A[g+8][2t, 2t+1], a4,a5 = A[g][2t+8,
    2t+9], a6,a7 = A[g+8][2t+8, 2t+9]; B[k][n] (16 x 8): b0,b1 = B[2t, 2t+1][g], b2,b3 = B[2t+8, 2t+9][g].  a_regs
    [32, 4] and b_regs [32, 2] float16 pairs as uint32 (low half first).  Returns D [16, 8] float64."""
    def halves(r):
        return np.frombuffer(np.asarray(r, np.uint32).tobytes(), np.float16).astype(np.float64)
    A, Bm = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a = halves(a_regs[lane])
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a[0:2], a[2:4]
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a[4:6], a[6:8]
        b = halves(b_regs[lane])
        Bm[2 * t:2 * t + 2, g], Bm[2 * t + 8:2 * t + 10, g] = b[0:2], b[2:4]
    return A @ Bm


def _decode_word(w: int, s2: int):
    """ffi/cuda_mxfp4_gate_up.cu's Decode on a host int: four float16 pairs (uint32), times the scale pair s2."""
    M, S, f = 0x0E000E00, 0x80008000, 0xFFFFFFFF
    rs = [(((w << 9) & M) | ((w << 12) & S)) & f, (((w << 1) & M) | ((w << 4) & S)) & f,
          (((w << 5) & M) | ((w << 8) & S)) & f, ((w >> 3) & M) | (w & S)]
    sc = np.frombuffer(np.uint32(s2).tobytes(), np.float16)
    return [np.frombuffer((np.frombuffer(np.uint32(r).tobytes(), np.float16) * sc).astype(np.float16).tobytes(),
                          np.uint32)[0] for r in rs]


@pytest.mark.parametrize("nb,every", [(1, False), (1, True), (5, False), (8, False)])
def test_mxfp4_gate_up_lane_layout_is_the_dot(nb, every):
    """The CUDA kernels' data flow, emulated on the host from the PTX ISA's fragment layout (not from the kernel's code
    paths): a warp's 16 rows x one 128-code chunk, each lane decoding its two rows' 16-byte groups word by word, the
    words' pairs into A registers as the kernel's Multiply passes them, and lane (g, t)'s B registers token g's inputs
    of group t in `lanes_order` (zeros for g >= nb: one token, lanes 0-3 only; the wide form, up to 8; `every`: the raw
    form, every lane token 0's, so that every column of D is its sums).  The kernels
    read D back per lane as d0 = D[g][2t], d1 = D[g][2t + 1], d2 = D[g + 8][2t], d3 = D[g + 8][2t + 1] (the one-token
    kernels lanes t = 0's d0 and d2): every token's column equals its dot with the dequantised rows, exactly (every
    product and partial sum here is exact in float64), and the columns past nb are zeros; so a wrong shift, mask, pair
    order, register order or input permutation moves it."""
    from jaxk3.kernels import moe_experts as ME
    from jaxk3.kernels import mxfp4_cuda as CU

    rng = np.random.default_rng(5)
    codes = rng.integers(0, 256, (16, 64), dtype=np.uint8)  # 16 rows x 128 codes (4 groups of 32)
    scales = rng.integers(104, 129, (16, 4), dtype=np.uint8)
    x = rng.standard_normal((nb, 128)).astype(np.float16)
    ref = np.asarray(ME.dequantize(ME.MXFP4(jnp.asarray(codes), jnp.asarray(scales))), np.float64) @ x.T.astype(np.float64)
    # [token, lane t, word j, the 4 registers of word j]
    xw = np.frombuffer(np.asarray(CU.lanes_order(jnp.asarray(x))).tobytes(), np.uint32).reshape(nb, 4, 4, 4)
    d = np.zeros((16, 8))
    for j in range(4):  # word j of each lane's group: mma steps 2j and 2j + 1
        a = np.zeros((2, 32, 4), np.uint32)
        b = np.zeros((2, 32, 2), np.uint32)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            p, q = ([*_decode_word(int(np.frombuffer(codes[r, 16 * t:16 * t + 16].tobytes(), np.uint32)[j]),
                                   int((((int(scales[r, t]) - 98) << 10) * 0x10001)))] for r in (g, g + 8))
            a[0, lane], a[1, lane] = (p[0], q[0], p[1], q[1]), (p[2], q[2], p[3], q[3])
            if g < nb or every:  # token g's words of group t (the kernels' has_x; `every`: token 0's)
                tok = 0 if every else g
                b[0, lane], b[1, lane] = xw[tok, t, j, 0:2], xw[tok, t, j, 2:4]
        d += _mma_m16n8k16(a[0], b[0]) + _mma_m16n8k16(a[1], b[1])
    red = np.full((16, 8), np.nan)
    for lane in range(32):  # the kernels' per-lane read of D (cuda_mxfp4.h's TokensToShared)
        g, t = lane // 4, lane % 4
        red[g, 2 * t], red[g, 2 * t + 1], red[g + 8, 2 * t], red[g + 8, 2 * t + 1] = (
            d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1])
    np.testing.assert_array_equal(red[:, :nb], ref)
    np.testing.assert_array_equal(red[:, nb:], np.repeat(ref, 8 - nb, axis=1) if every else 0)
    assert np.abs(ref).max() > 0


def _f16_scaled_spec(x64: np.ndarray) -> tuple[int, np.ndarray]:
    """`f16_scaled`'s rule for one row, in float64 (numpy: no flushing of subnormals): k = clip(15 - e, -126, 126) for
    the largest magnitude m in [2^(e-1), 2^e), 0 for zeros or a NaN (where(m > 0) is false), 15 for an infinity
    (frexp's e = 0); the row times 2^k rounded to float16 (to nearest even), in `lanes_order`."""
    from jaxk3.kernels import mxfp4_cuda as CU

    m = np.abs(x64).max()
    if np.isnan(m) or m == 0:
        k = 0
    else:
        k = int(np.clip(15 - (0 if np.isinf(m) else np.frexp(m)[1]), -126, 126))
    with np.errstate(invalid="ignore", over="ignore"):
        v = (x64 * 2.0 ** k).astype(np.float16)
    return k, np.asarray(CU.lanes_order(jnp.asarray(v)))


def test_mxfp4_stream_grid_balances_the_items():
    """The streaming kernels' persistent grid (ffi/cuda_mxfp4.h's StreamGrid, compiled for the CPU by nvcc:
    tests/native/mxfp4_stream_grid.cu): never more CTAs than items, than fit the GPU at once, or than the tests' cap;
    no more rounds of items than the most CTAs would take; and every CTA (taking items c, c + grid, ...) the same number
    of items or one fewer.  K3's TP 2 share at one token: 1536 items where 924 CTAs fit run as 768 CTAs of two."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc to compile ffi/cuda_mxfp4.h's StreamGrid for the CPU")
    root = Path(__file__).resolve().parents[1]
    rng = np.random.default_rng(5)
    cases = [(1536, 924, 0), (3584, 1056, 0), (3072, 924, 0), (768, 1056, 0), (768, 1056, 7), (1, 924, 0),
             (5, 1, 0), (1000, 1000, 0), (1001, 1000, 0)]
    cases += [(int(rng.integers(1, 20000)), int(rng.integers(1, 1500)), int(rng.choice([0, 1, 3, 131])))
              for _ in range(300)]
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "grid"
        subprocess.run([nvcc, "-std=c++17", f"-I{root / 'ffi'}", "-o", str(exe),
                        str(root / "tests/native/mxfp4_stream_grid.cu")], check=True, capture_output=True, timeout=300)
        got = subprocess.run([str(exe)], input="\n".join(f"{i} {f} {c}" for i, f, c in cases), text=True,
                             check=True, capture_output=True, timeout=60).stdout.split()
    assert len(got) == len(cases)
    for (items, fit, cap), n in zip(cases, map(int, got)):
        most = min(items, fit, cap or items)
        per = [-(-(items - c) // n) for c in range(n)]  # items a CTA takes: c, c + n, ...
        assert 1 <= n <= most and sum(per) == items and max(per) - min(per) <= 1, (items, fit, cap, n)
        assert max(per) == -(-items // most), (items, fit, cap, n)  # no more rounds than the most CTAs take
    assert int(got[0]) == 768 and int(got[1]) == 896 and int(got[2]) == 768


def test_mxfp4_cuda_raw_input_is_f16_scaled():
    """The CUDA kernels' raw form makes their float16 input themselves (ffi/cuda_mxfp4.h: MaxMagnitude, ScaleExponent,
    Pow2, ToLanes, host and device code): the header compiled for the CPU by nvcc (tests/native/mxfp4_raw_input.cu)
    gives, bit for bit, the k and values of `f16_scaled`'s rule in `lanes_order` (`_f16_scaled_spec`, float64) for
    rows of every scale, zeros, float16's rounding ties, NaN and infinite rows and a subnormal largest magnitude; and
    `f16_scaled` itself (XLA on the CPU) agrees on the finite rows with a normal largest magnitude.  (It differs on
    the subnormal row, which XLA on the CPU flushes to zero, k = 0, and a batched reduction there may drop a row's NaN:
    documented at ScaleExponent.)"""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from jaxk3.kernels import moe_experts as ME
    from jaxk3.kernels import mxfp4_cuda as CU

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc to compile ffi/cuda_mxfp4.h's helpers for the CPU")
    root = Path(__file__).resolve().parents[1]
    rng = np.random.default_rng(11)
    N = 64
    rows = [rng.standard_normal(N) * 10.0 ** e for e in (-30, -8, -3, 0, 2, 5, 30)]
    rows.append(np.zeros(N))
    ties = rng.standard_normal(N)  # k = 0 (the largest 2^14); float16's subnormal steps of 2^-24: ties to even
    ties[:9] = [2.0 ** 14, 0.5 * 2 ** -24, 1.5 * 2 ** -24, 2.5 * 2 ** -24, -3.5 * 2 ** -24, 1.25 * 2 ** -24,
                -0.5 * 2 ** -24, 0.75 * 2 ** -24, 2 ** -30]
    rows.append(ties)
    rows.append(np.full(N, -(2.0 ** 14)))  # exactly 2^14 (negative): k = 0
    rows.append(np.where(np.arange(N) % 3 == 0, 1e-39, 0.0) * rng.standard_normal(N))  # largest < 2^-126: subnormal
    nan_row, inf_row = rng.standard_normal(N), rng.standard_normal(N)
    nan_row[5], inf_row[9] = np.nan, -np.inf
    rows += [nan_row, inf_row]
    rows += [rng.standard_normal(N) * 2.0 ** rng.integers(-100, 100) for _ in range(40)]
    x = jnp.asarray(np.stack(rows), jnp.bfloat16)
    bits = np.asarray(x).view(np.uint16)
    with tempfile.TemporaryDirectory() as d:
        exe, src, dst = Path(d) / "raw", Path(d) / "in.bin", Path(d) / "out.bin"
        subprocess.run([nvcc, "-std=c++17", f"-I{root / 'ffi'}", "-o", str(exe),
                        str(root / "tests/native/mxfp4_raw_input.cu")], check=True, capture_output=True, timeout=300)
        src.write_bytes(np.array(bits.shape, np.int32).tobytes() + bits.tobytes())
        subprocess.run([str(exe), str(src), str(dst)], check=True, timeout=60)
        out = np.frombuffer(dst.read_bytes(), np.uint8).reshape(len(rows), 4 + 2 * N)
    k = out[:, :4].copy().view(np.int32)[:, 0]
    got = out[:, 4:].copy().view(np.float16)
    x16, inv = ME.f16_scaled(x)
    xla = np.asarray(CU.lanes_order(x16))
    xla_k = -np.log2(np.asarray(inv)[:, 0]).astype(np.int32)
    special = {len(rows) - 43: "subnormal", len(rows) - 42: "nan", len(rows) - 41: "inf"}
    for r in range(len(rows)):
        x64 = np.asarray(x[r], np.float64)
        kk, want = _f16_scaled_spec(x64)
        assert k[r] == kk, (r, k[r], kk)
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got[r]), nan)
        np.testing.assert_array_equal(got[r][~nan].view(np.uint16), want[~nan].view(np.uint16))
        if r not in special:  # XLA's own f16_scaled on the CPU: the same bits
            assert xla_k[r] == kk, (r, xla_k[r], kk)
            np.testing.assert_array_equal(xla[r].view(np.uint16), want.view(np.uint16))
    assert [k[r] for r in sorted(special)] == [126, 0, 15] and k[len(rows) - 44] == 0  # and exactly 2^14: 0
    assert np.abs(got[len(rows) - 43]).max() > 0 and np.isinf(got[len(rows) - 41]).any()
    t = np.asarray(x16[len(rows) - 45, :9], np.float64) * 2.0 ** 24  # the ties row: rounded to even steps
    np.testing.assert_array_equal(t, [2.0 ** 38, 0, 2, 2, -4, 1, -0.0, 1, 0])


def test_mxfp4_cuda_refuses_another_build(monkeypatch):
    """An extension whose CUDA kernels take another calling convention (`cuda_kernels_abi`: built before or after a
    change to their operands) is refused by name, not registered to fail its first call; this build's is this code's."""
    import sys
    import types

    from jaxk3.kernels import mxfp4_cuda as CU

    try:
        from jaxk3 import _ffi
    except ImportError as e:
        pytest.skip(f"the jaxk3._ffi extension is not built ({e})")
    if getattr(_ffi, "cuda_kernels", dict)():  # (built with CUDA: this build's convention is this code's)
        assert _ffi.cuda_kernels_abi == CU.ABI
    fake = types.SimpleNamespace(cuda_kernels=lambda: {CU.TARGET: object(), CU.DOWN_TARGET: object()},
                                 cuda_kernels_abi=CU.ABI - 1)
    monkeypatch.setitem(sys.modules, "jaxk3._ffi", fake)
    monkeypatch.setattr(sys.modules["jaxk3"], "_ffi", fake, raising=False)
    monkeypatch.setattr(CU, "_found", [])
    for target in (CU.TARGET, CU.DOWN_TARGET):
        assert f"calling convention {CU.ABI - 1}, this code calls {CU.ABI}" in CU._register(target)


def test_moe_experts_cuda_gate_up_refusals():
    """`cuda=True` is refused by `fits` with the reason (on this CPU: no CUDA device; several tokens without the wide
    form, or a shape it cannot take; a stack not marked f16), and the routed form refuses it; `cuda=None` (the
    default) needs nothing."""
    from jaxk3.kernels import moe_experts as ME

    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, 1)
    c = ME.Config(cuda=True)
    assert "moe_experts kernel: cuda:" in ME.fits(cfg, w, z, wk, ids, config=c, only_where_faster=False)
    cfg8, w8, z8, wk8, ids8 = _moe_case("mxfp4", jnp.bfloat16, 8)
    # several tokens: the wide form by default (CUDA_WIDE), refused here for this tiny layer's shape; without it, the
    # one-token forms refuse them
    assert "multiple of 256" in ME.fits(cfg8, w8, z8, wk8, ids8, config=c, only_where_faster=False)
    assert "one token" in ME.fits(cfg8, w8, z8, wk8, ids8, config=ME.Config(cuda=True, cuda_wide=False),
                                  only_where_faster=False)
    assert "not marked f16" in ME.fits(cfg, ME.with_f16(w, False), z, wk, ids, config=c, only_where_faster=False)
    logits = jnp.zeros((1, w.experts_w2.packed.shape[0]), jnp.float32)
    assert "CUDA kernels" in ME.routed_fits(cfg, w, z, logits, w.e_score_correction_bias, config=c)
    assert "CUDA kernels" in ME.routed_fits(cfg, w, z, logits, w.e_score_correction_bias, config=ME.Config(cuda_down=True))
    # kernel 2 in CUDA: refused with its reason here (no CUDA device), and its own tiling rule
    assert "moe_experts kernel: cuda_down:" in ME.fits(cfg, w, z, wk, ids, config=ME.Config(cuda_down=True),
                                                       only_where_faster=False)
    from jaxk3.kernels import mxfp4_cuda as CU
    assert CU.down_problem(16, 3072, 3584, 4) is None and CU.down_problem(16, 1536, 3584, 4) is None
    assert "multiple of 128" in CU.down_problem(16, 64, 3584, 4)
    assert "shared memory" in CU.down_problem(16, 6144, 3584, 1)
    assert "slot parts" in CU.down_problem(16, 3072, 3584, 0)
    assert ME.fits(cfg, w, z, wk, ids, config=ME.Config(), only_where_faster=False) is None
    # Config.f16 at one token is a dot over 8 padded rows: not the form the CUDA kernel replaces, whatever the device
    cfw, ww, zw, wkw, idsw = _moe_case("mxfp4", jnp.bfloat16, 1, routed_expert_hidden_size=512)
    _, I, In, Out, _ = ME._dims(ww)
    cf = ME._resolve(ME.Config(f16=True), 1, In, I, Out, True, zw.dtype, True)
    assert "Config.f16" in ME._cuda_problem(cf, ww, zw, None)


@pytest.mark.parametrize("form,B", [("f16", 1), ("raw", 1), ("wide", 1), ("wide", 5), ("wide", 8)])
def test_moe_experts_cuda_forms_lowered(monkeypatch, form, B):
    """The CUDA kernels' calls as `moe_experts` lowers them (here on the CPU, their availability patched in: lowering
    needs no GPU), in each input form: "f16" hands both kernels XLA's float16 copies, "raw" their bf16 inputs as they
    are, with no float16 anywhere in the module (no XLA fusion scales or permutes them), "wide" the B tokens' float16
    rows [B, In] (kernel 1's output padded to the Pallas kernel 2's 8 rows past one token) and each slot's rows
    [U, Bp, I] with the tokens' coefficients [Bp, U] (kernel 2's partial sums [G, Bp, Out]); `cuda_l2` reaches both
    calls' attributes.  At B > 1 only the wide form is taken (the default there: CUDA_WIDE)."""
    from jaxk3.kernels import moe_experts as ME
    from jaxk3.kernels import mxfp4_cuda as CU

    monkeypatch.setattr(CU, "unavailable", lambda target=CU.TARGET: None)
    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, B, routed_expert_hidden_size=1536, moe_intermediate_size=768)
    E, k = w.experts_w2.packed.shape[0], ids.shape[1]
    U, Bp = (k, 1) if B == 1 else (min(E, B * k), 8)
    for l2 in (False, True):
        c = ME.Config(cuda=True, cuda_down=True, cuda_raw=form == "raw", cuda_wide=form == "wide", cuda_l2=l2)
        assert ME.fits(cfg, w, z, wk, ids, config=c, only_where_faster=False) is None
        hlo = jax.jit(lambda *a, c=c: ME.experts(cfg, *a, config=c)).lower(w, z, wk, ids).as_text()
        calls = [ln for ln in hlo.splitlines() if "stablehlo.custom_call" in ln and "jaxk3_mxfp4" in ln]
        assert len(calls) == 2 and CU.TARGET in calls[0] and CU.DOWN_TARGET in calls[1], calls
        assert all(f"l2 = {int(l2)} : i64" in ln for ln in calls), calls
        assert (re.search(r"[x<]f16>", hlo) is None) == (form == "raw")  # a float16 tensor anywhere (not bf16)
        G = int(re.search(r"-> tensor<(\d+)x", calls[1]).group(1))
        if form == "wide":
            assert f"(tensor<{U}xi32>, tensor<{B}x1536xf16>, tensor<{B}xf32>, " in calls[0], calls[0]
            assert f"-> tensor<{U}x{Bp}x768xbf16>" in calls[0], calls[0]
            assert f"(tensor<{U}xi32>, tensor<{Bp * U}xf32>, tensor<{U}x{Bp}x768xf16>, tensor<{U * Bp}xf32>, " in calls[1]
            assert f"-> tensor<{G}x{Bp}x1536xf32>" in calls[1], calls[1]
        else:
            t = "bf16" if form == "raw" else "f16"  # the token [In], each slot's activations [U, I]
            assert f"(tensor<{U}xi32>, tensor<1536x{t}>, " in calls[0], calls[0]
            assert f"(tensor<{U}xi32>, tensor<{U}xf32>, tensor<{U}x768x{t}>, " in calls[1], calls[1]
    if B > 1:  # the one-token forms are refused at B > 1, and the wide form with tokens padded past 8, with the reasons
        one = ME.Config(cuda=True, cuda_wide=False)
        assert "1 to 8 with Config.cuda_wide" in ME.fits(cfg, w, z, wk, ids, config=one, only_where_faster=False)
        assert ME.fits(cfg, w, z, wk, ids, config=ME.Config(cuda=True), only_where_faster=False) is None  # CUDA_WIDE
        for pad16 in (dict(swap=False), dict(f16=False)):  # the Pallas kernels' 16 rows (mx_dot, or f16 without swap)
            c = ME.Config(cuda=True, cuda_wide=True, **pad16)
            assert "at most 8 token rows" in ME.fits(cfg, w, z, wk, ids, config=c, only_where_faster=False)
            c = ME.Config(cuda_down=True, cuda_wide=True, **pad16)
            assert "at most 8 token rows" in ME.fits(cfg, w, z, wk, ids, config=c, only_where_faster=False)
            _, I, In, Out, _ = ME._dims(w)  # and `_launch`'s own test of the same (it then takes the Pallas kernels)
            cf = ME._resolve(ME.Config(cuda_wide=True, **pad16), B, In, I, Out, True, z.dtype, True)
            assert "at most 8 token rows" in ME._cuda_problem(cf, w, z, None)


def test_moe_experts_cuda_stream_lowered_and_refused(monkeypatch):
    """The CUDA kernels' streaming form (`Config.cuda_stages`) as `moe_experts` lowers it (on the CPU, the kernels'
    availability patched in): the ring depth reaches kernel 1's `stages` attribute (by default CUDA_STAGES at one
    token, CUDA_STAGES_WIDE in the wide form), at one token and in the wide form, and kernel 2's at one token
    only and only when asked for (CUDA_STAGES is kernel 1's), where it takes one slot a
    part (its partial sums [U, 1, Out]; the wide form keeps its register kernel 2); `fits` refuses a depth neither
    kernel has an instance of and kernel 1's raw form, with the reason, before anything compiles; and
    `mxfp4_cuda.gate_up` and `down` refuse those, the wide kernel 2 and more slots than their shared-memory table
    holds themselves (direct calls)."""
    from jaxk3.kernels import moe_experts as ME
    from jaxk3.kernels import mxfp4_cuda as CU

    monkeypatch.setattr(CU, "unavailable", lambda target=CU.TARGET: None)
    for B in (1, 5):
        cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, B, routed_expert_hidden_size=1536,
                                       moe_intermediate_size=768)
        assert (ME.CUDA_STAGES, ME.CUDA_STAGES_WIDE) == (4, 8)  # (the defaults below: kernel 1's)
        for stages, want in ((None, 4 if B == 1 else 8), (0, 0), (4, 4), (6, 6), (8, 8)):
            c = ME.Config(cuda=True, cuda_down=True, cuda_stages=stages)  # (kernel 2 in CUDA too: no Pallas call to
            # lower on the CPU)
            assert ME.fits(cfg, w, z, wk, ids, config=c, only_where_faster=False) is None
            hlo = jax.jit(lambda *a, c=c: ME.experts(cfg, *a, config=c)).lower(w, z, wk, ids).as_text()
            calls = [ln for ln in hlo.splitlines() if "stablehlo.custom_call" in ln and CU.TARGET in ln]
            assert len(calls) == 1 and f"stages = {want} : i64" in calls[0] and "ctas = 0 : i64" in calls[0], calls
            # kernel 2: the streaming form at one token only and only where asked for, one slot a part (its output
            # [U, 1, Out]); else 4 parts
            down = [ln for ln in hlo.splitlines() if "stablehlo.custom_call" in ln and CU.DOWN_TARGET in ln]
            dwant = want if B == 1 and stages is not None else 0
            U = ids.shape[1] if B == 1 else None
            assert len(down) == 1 and f"stages = {dwant} : i64" in down[0], down
            if B == 1:
                assert f"-> tensor<{U if dwant else 4}x1x1536xf32>" in down[0], down[0]
        for bad, why in ((ME.Config(cuda=True, cuda_stages=5), "stages must be one of"),
                         (ME.Config(cuda=True, cuda_stages=4, cuda_raw=True, cuda_wide=False), "not the raw form")):
            if B == 1 or bad.cuda_raw is None:
                assert why in ME.fits(cfg, w, z, wk, ids, config=bad, only_where_faster=False), bad
        if B == 1:  # kernel 2's own refusal (kernel 1 in Pallas)
            bad = ME.Config(cuda=False, cuda_down=True, cuda_stages=5)
            assert "jaxk3_mxfp4_down: stages must be one of" in ME.fits(cfg, w, z, wk, ids, config=bad,
                                                                         only_where_faster=False)
    assert "at most 512 slots" in CU.stream_problem(4, 513, False) and CU.stream_problem(4, 512, False) is None
    assert CU.stream_problem(0, 10_000, True) is None  # the register form takes any
    # the defaults fall back to the register form where the streaming form cannot take the call (the raw form, more
    # slots than its table holds), and the wide form takes CUDA_STAGES_WIDE at one token too
    c = ME.Config()
    assert [ME._cuda_stages(c, f, 16) for f in ("f16", "wide", "raw")] == [ME.CUDA_STAGES, ME.CUDA_STAGES_WIDE, 0]
    assert ME._cuda_stages(c, "f16", 513) == 0 and ME._cuda_stages(c, "wide", 513) == 0
    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, 1, routed_expert_hidden_size=1536, moe_intermediate_size=768)
    for c, want in ((ME.Config(cuda=True, cuda_down=True, cuda_raw=True, cuda_wide=False), 0),
                    (ME.Config(cuda_down=True, cuda_wide=True), 8)):  # (kernel 2 in CUDA: lowers on the CPU)
        assert ME.fits(cfg, w, z, wk, ids, config=c, only_where_faster=False) is None
        hlo = jax.jit(lambda *a, c=c: ME.experts(cfg, *a, config=c)).lower(w, z, wk, ids).as_text()
        calls = [ln for ln in hlo.splitlines() if "stablehlo.custom_call" in ln and CU.TARGET in ln]
        assert len(calls) == 1 and f"stages = {want} : i64" in calls[0], (c, calls)
    # an explicit depth the kernel has no instance of is refused by `fits` with kernel 1 in CUDA by default too
    # (Config.cuda None), not at the call
    for bad, why in ((ME.Config(cuda_stages=5), "stages must be one of"),
                     (ME.Config(cuda_stages=4, cuda_raw=True, cuda_wide=False), "not the raw form")):
        assert why in (ME.fits(cfg, w, z, wk, ids, config=bad, only_where_faster=False) or ""), bad
    _, w, z, _, ids = _moe_case("mxfp4", jnp.bfloat16, 1, routed_expert_hidden_size=1536, moe_intermediate_size=768)
    x16, inv = ME.f16_scaled(z)
    for kw, why in ((dict(stages=2), "stages must be one of"), (dict(stages=4, raw=True), "not the raw form")):
        raw = kw.pop("raw", False)
        with pytest.raises(ValueError, match=why):
            CU.gate_up(ids[0], z[0] if raw else x16[0], None if raw else inv[0], w.experts_w1, w.experts_w3, 0, 768,
                       "situ", 4.0, 25.0, **kw)
    # kernel 2 (direct calls): a depth it has no instance of, the raw and wide forms, more slots than its table
    a = jnp.ones((16, 768), jnp.bfloat16)
    a16, ainv = ME.f16_scaled(a)
    c16 = jnp.ones((16,), jnp.float32)
    for args, why in (((a16, ainv[:, 0]), "stages must be one of"), ((a, None), "not the raw form"),
                      ((a16[:, None], ainv), "one token's activations")):
        with pytest.raises(ValueError, match=why):
            CU.down(jnp.arange(16, dtype=jnp.int32), c16 if args[0].ndim == 2 else c16[None], *args, w.experts_w2,
                    16, stages=5 if why.startswith("stages") else 4)
    assert "at most 512 slots" in CU.stream_problem(4, 513, False, CU.DOWN_TARGET)


def _cuda_kernels_or_skip(gate_up: bool = True, down: bool = False):
    """The CUDA MXFP4 kernels' modules (moe_experts, mxfp4_cuda) where a CUDA GPU and the extension's kernels asked for
    are there; else the test skips with the reason."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda) and the extension built with CUDA")
    from jaxk3.kernels import moe_experts as ME
    from jaxk3.kernels import mxfp4_cuda as CU

    # (as the gathers' GPU tests do without the extension's CUDA handlers)
    for target in [CU.TARGET] * gate_up + [CU.DOWN_TARGET] * down:
        if CU.unavailable(target):
            pytest.skip(f"{CU.unavailable(target)} (scripts/gpu_check.sh build)")
    return ME, CU


def _flip_atol(cfg, w, z, wk, ids, rel: float = 2.0**-20) -> np.ndarray:
    """The experts' tolerance per output element [B, L] beyond float32 sum order, from the activations' rounding to
    bf16: each is rounded from float32 sums whose order differs between a kernel and the jnp reference, so one that
    lies within `rel` of itself (8 to 16 float32 ulps) of a bf16 rounding tie may land on either side, and one bf16 ulp
    of it reaches every output of its token through its expert's down row times the token's coefficient.  Here: the
    gate and up sums in float64 (the weights dequantised), the activation of their float32 roundings, and the sum over
    the near-tie ones of |coef| · |W2[:, j]| · ulp(a_j).  On an H200 a B = 2 case's second token came out 2.134e-5 off
    at worst (the CUDA wide kernel 2 after the Pallas kernel 1, 2026-12-05): one of its activations is a tie exactly,
    and its ulp through the down row is 2.126e-5 (`test_flip_atol_holds_the_h200s_one_flip`).  A token with no
    activation near a tie gets 0."""
    import ml_dtypes

    from jaxk3.kernels import moe_experts as ME

    def f64(m):
        return np.asarray(ME.dequantize(m) if hasattr(m, "packed") else m, np.float64)

    if getattr(w, "experts_w13", None) is not None:
        w13 = f64(w.experts_w13)
        w1, w3 = w13[:, : w13.shape[1] // 2], w13[:, w13.shape[1] // 2:]
    else:
        w1, w3 = f64(w.experts_w1), f64(w.experts_w3)
    w2, zz = f64(w.experts_w2), np.asarray(jnp.asarray(z, jnp.float32), np.float64)
    ii, cc = np.asarray(ids), np.asarray(wk, np.float64)
    out = np.zeros((zz.shape[0], w2.shape[1]))
    for b in range(zz.shape[0]):
        for k in range(ii.shape[1]):
            e = ii[b, k]
            h1, h3 = (jnp.asarray(m[e] @ zz[b], jnp.float32) for m in (w1, w3))
            a = np.asarray(ME.act(cfg, h1, h3), np.float64)
            ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(a), 1e-38))) - 7)  # bf16's spacing at |a|
            tie = np.abs(np.abs(a - a.astype(ml_dtypes.bfloat16).astype(np.float64)) - ulp / 2)
            near = tie <= rel * np.abs(a)
            out[b] += abs(cc[b, k]) * (np.abs(w2[e][:, near]) @ ulp[near])
    return out


def test_flip_atol_holds_the_h200s_one_flip():
    """`_flip_atol` at the B = 2 case that an H200 put 2.134e-5 off at worst (absolute; 2.1e-5 of max|ref|): its second
    token has an activation whose float32 value is a bf16 rounding tie exactly (found with no margin), and one bf16 ulp
    of it through its down row is 2.126e-5 at worst, that error; the default margin's bound covers it and is not a
    blanket tolerance (at most 1e-3 of max|ref|, its median under 1e-4: 3.0e-4 and 2.7e-5 here)."""
    from jaxk3.kernels import moe_experts as ME

    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, 2, routed_expert_hidden_size=1536, moe_intermediate_size=768,
                                   num_experts_per_token=10)
    exact, atol = _flip_atol(cfg, w, z, wk, ids, rel=0.0), _flip_atol(cfg, w, z, wk, ids)
    m = np.abs(np.asarray(ME.experts_partial(cfg, w, z, wk, ids))).max()
    assert exact[0].max() == 0 and 2.10e-5 < exact[1].max() < 2.15e-5
    assert (atol >= exact).all() and atol.max() / m < 1e-3 and np.median(atol) / m < 1e-4


def _cuda_forms_agree(case, configs, targets) -> None:
    """Each Config of `configs`, compiled (`moe_experts.experts` under jit) on `case` (cfg, w, z, wk, ids): `fits`
    takes it, the lowered module holds the CUDA targets `targets(c)` says ({target: present}) and the L2 hint as
    `c.cuda_l2` says, its output is within the float16 forms' tolerance of the jnp reference (2e-5 of max|ref|: float32
    sums in another order of exact products; plus, per element, `_flip_atol`: the activations near a bf16 tie), and
    every config's output is the first's, bit for bit."""
    from jaxk3.kernels import moe_experts as ME

    cfg, w, z, wk, ids = case
    ref = np.asarray(ME.experts_partial(cfg, w, z, wk, ids))
    atol = 2e-5 * np.abs(ref).max() + _flip_atol(cfg, w, z, wk, ids)
    first = None
    for c in configs:
        assert ME.fits(cfg, w, z, wk, ids, config=c, only_where_faster=False) is None, c
        f = jax.jit(lambda *a, c=c: ME.experts(cfg, *a, config=c))
        hlo = f.lower(w, z, wk, ids).as_text()
        assert all((t in hlo) == present for t, present in targets(c).items()), (c, targets(c))
        assert ("l2 = 1" in hlo) == bool(c.cuda_l2), c
        got = np.asarray(f(w, z, wk, ids))
        assert got.shape == ref.shape
        bad = np.abs(got - ref) > atol
        assert not bad.any(), (c, f"{bad.sum()} of {bad.size} elements past the tolerance; worst |got - ref| / atol "
                                  f"{(np.abs(got - ref) / atol).max():.3g}, at {np.argwhere(bad)[:5].tolist()}")
        if first is None:
            first = got
        else:
            np.testing.assert_array_equal(got, first)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["checkpoint", "joined"])
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_experts_cuda_gate_up_on_gpu(layout, act):
    """The CUDA gate-up (kernel 1 at one token, MXFP4 marked f16) with the Pallas kernel 2, compiled, against the jnp
    reference (a tiny K3 layer widened to an input of 1536 and I 64: the kernel's tiling, 6 iterations a warp, so its
    loads' refill and a partial last round run), w1 and w3 apart and joined, SiTU and SiLU, in each of its forms
    (`cuda_raw`: the token converted in the kernel; `cuda_l2`: the loads' L2 hint; `cuda_wide`: the token read
    through L1), bitwise equal to each other.  Tolerance as the float16 form's: float32 sums in another order
    (tensor-core accumulation) of exact products, then one bf16 rounding of the activations, 2e-5 of max|ref| plus
    `_flip_atol`; and the path ran (its target is traced)."""
    ME, CU = _cuda_kernels_or_skip()
    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, 1, routed_expert_hidden_size=1536, hidden_act=act)
    if layout == "joined":
        w = _joined(w)
    # (raw, l2, wide): the kernel's forms.  The raw form's float16 copy is f16_scaled's, the wide form reads the same
    # values from global memory, the hint changes none: the same bits
    forms = ((False, False, False), (True, False, False), (False, True, False), (True, True, False),
             (False, False, True), (False, True, True))
    _cuda_forms_agree((cfg, w, z, wk, ids), [ME.Config(cuda=True, cuda_raw=r, cuda_l2=l2, cuda_wide=wd)
                                             for r, l2, wd in forms], lambda c: {CU.TARGET: True})


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["checkpoint", "joined"])
@pytest.mark.parametrize("B", [1, 2, 5, 8])
def test_moe_experts_cuda_stream_on_gpu(layout, B):
    """Kernel 1's streaming form (`Config.cuda_stages` 4, 6, 8: persistent CTAs, the weights through a ring in shared
    memory) in `moe_experts`, compiled, with the Pallas kernel 2: an input of 1536 (6 iterations a warp, so the 8-deep
    ring spans two items) and I 768, 10 choices a token of 16 experts, one token (XLA's float16 copy in shared memory)
    and 2, 5, 8 (the wide form); bitwise equal to the register form, within the float16 forms' tolerance of the jnp
    reference (2e-5 of max|ref| plus `_flip_atol`), and its call carries the depth.  At one token also with kernel 2
    streaming (`cuda_down`): the depths bitwise equal to each other and within the same tolerance."""
    ME, CU = _cuda_kernels_or_skip()
    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, B, routed_expert_hidden_size=1536, moe_intermediate_size=768,
                                   num_experts_per_token=10)
    if layout == "joined":
        w = _joined(w)
    configs = [ME.Config(cuda=True, cuda_l2=True, cuda_stages=s) for s in (0, 4, 6, 8)]
    _cuda_forms_agree((cfg, w, z, wk, ids), configs,
                      lambda c: {CU.TARGET: True, f"stages = {c.cuda_stages} : i64": True})
    if B == 1:  # kernel 2 streaming too (its own sum order: the depths agree with each other, not with the above)
        _, CU2 = _cuda_kernels_or_skip(down=True)
        configs = [ME.Config(cuda=True, cuda_down=True, cuda_l2=True, cuda_stages=s) for s in (4, 6, 8)]
        for c in configs:  # kernel 2's call streams, one slot a part (10 slots: partial sums [10, 1, 1536])
            hlo = jax.jit(lambda *a, c=c: ME.experts(cfg, *a, config=c)).lower(w, z, wk, ids).as_text()
            down = [ln for ln in hlo.splitlines() if "stablehlo.custom_call" in ln and CU2.DOWN_TARGET in ln]
            assert len(down) == 1 and f"stages = {c.cuda_stages} : i64" in down[0], down
            assert "-> tensor<10x1x1536xf32>" in down[0], down[0]
        _cuda_forms_agree((cfg, w, z, wk, ids), configs, lambda c: {CU2.DOWN_TARGET: True})


@pytest.mark.gpu
@pytest.mark.parametrize("nb,In", [(0, 1536), (1, 1536), (3, 1536), (8, 1536), (0, 3584), (5, 3584)])
def test_mxfp4_gate_up_stream_items_on_gpu(nb, In):
    """The streaming form's persistent CTAs taking many items each (`ctas` caps the grid at 1, 3, 7 and 131 CTAs, so
    that items fall unevenly and each CTA's ring runs on across items and slots, an empty slot's (-1, and one past E)
    among them), called directly (`mxfp4_cuda.gate_up`) on 16 slots x 48 row blocks: each depth and cap gives the
    register form's output bit for bit (bf16 bits: -0 is not 0), one token (nb 0: XLA's float16 copy in shared memory)
    and the wide form's 1, 3, 5, 8 tokens (3 and 5 into 8 output rows: the rows past them zeros); at K3's routed input
    width (3584) too, where one token's 8-deep ring and token take 48,128 bytes of dynamic shared memory, past the 48 KB
    a kernel gets without opting in."""
    ME, CU = _cuda_kernels_or_skip()
    cfg, w, z, _, _ = _moe_case("mxfp4", jnp.bfloat16, max(nb, 1), routed_expert_hidden_size=In,
                                moe_intermediate_size=768)
    E, I = w.experts_w1.packed.shape[0], w.experts_w1.packed.shape[1]
    ids = jnp.asarray(np.random.default_rng(nb).permutation(E)[:16], jnp.int32).at[3].set(-1).at[11].set(E)
    x16, inv = ME.f16_scaled(z)
    x16, inv = (x16[0], inv[0]) if nb == 0 else (x16, inv)
    rows = 8 if nb in (3, 5) else None

    def call(stages, ctas):
        f = jax.jit(lambda i, x, v, g, u: CU.gate_up(i, x, v, g, u, 0, I, cfg.hidden_act, cfg.activation_situ_beta,
                                                     cfg.activation_situ_linear_beta, l2=True, rows=rows,
                                                     stages=stages, ctas=ctas))
        return np.asarray(f(ids, x16, inv, w.experts_w1, w.experts_w3)).view(np.uint16)

    ref = call(0, 0)
    assert ref.shape == (16, rows or max(nb, 1), I) and (ref[[0, 1, 2, 4]] & 0x7FFF).any()
    assert not ref[[3, 11]].any()  # the empty slots' rows are zeros (+0)
    if rows:
        assert not ref[:, nb:].any()
    for stages in (4, 6, 8):
        for ctas in (0, 1, 3, 7, 131):
            np.testing.assert_array_equal(call(stages, ctas), ref, err_msg=f"stages {stages}, ctas {ctas}")


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [16, 5, 1])
@pytest.mark.parametrize("I", [768, 640, 384, 256])
def test_mxfp4_down_stream_items_on_gpu(parts, I):
    """Kernel 2's streaming form at one token called directly (`mxfp4_cuda.down`): 16 slots (two empty: -1 and one
    past E) in 16 parts (one slot each, as `moe_experts` takes it), 5 (4 a part, the last part empty: zeros) and 1,
    over 112 row blocks of a 1792-wide output, I 768 (6 chunks: the 4 warps take 2, 2, 1, 1), 640 (5: 2, 1, 1, 1), 384
    (3: warp 3 takes none) and 256 (2: warps 2 and 3 none, committing empty groups); the grid capped at 1, 3, 7 and
    131 CTAs and not: every depth and cap gives the same bits (one sum order whatever the grid), within 2e-5 of
    max|ref| of the register form's (float32 sums of the same exact products in another order), and an empty part's
    rows are zeros.  (The 4 warps' sums meet in shared memory behind one barrier an item; warp 0, whose threads read
    them, never has fewer chunks than the others, so a missing barrier would show only by scheduling chance here.)"""
    ME, CU = _cuda_kernels_or_skip(gate_up=False, down=True)
    cfg, w, _, _, _ = _moe_case("mxfp4", jnp.bfloat16, 1, routed_expert_hidden_size=1792, moe_intermediate_size=I)
    E = w.experts_w2.packed.shape[0]
    rng = np.random.default_rng(parts + I)
    ids = jnp.asarray(rng.permutation(E)[:16], jnp.int32).at[5].set(-1).at[9].set(E)
    a16, ainv = ME.f16_scaled(jnp.asarray(rng.standard_normal((16, I)), jnp.bfloat16))
    coef = jnp.asarray(rng.uniform(0.1, 1.0, 16), jnp.float32)

    def call(stages, ctas):
        f = jax.jit(lambda i, c, x, v, m: CU.down(i, c, x, v, m, parts, l2=True, stages=stages, ctas=ctas))
        return np.asarray(f(ids, coef, a16, ainv[:, 0], w.experts_w2))

    first = call(4, 0)
    assert first.shape == (parts, 1, 1792) and np.abs(first).max() > 0
    if parts == 5:
        assert not first[4].any()  # per = 4: the fifth part has no slot
    for stages in (4, 6, 8):
        for ctas in (0, 1, 3, 7, 131):
            np.testing.assert_array_equal(call(stages, ctas).view(np.uint32), first.view(np.uint32),
                                          err_msg=f"stages {stages}, ctas {ctas}")
    reg = call(0, 0)  # the register form (a part's activations in shared memory: at most 30 slots of 768 here)
    np.testing.assert_allclose(first, reg, rtol=0, atol=2e-5 * np.abs(reg).max())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["checkpoint", "joined"])
@pytest.mark.parametrize("k,parts", [(10, 1), (10, 3), (10, 4), (4, 3)])
def test_moe_experts_cuda_down_on_gpu(layout, k, parts):
    """Kernel 2 at one token in CUDA (`Config(cuda_down=True)`), after either kernel 1, compiled, against the jnp
    reference: an input of 1536 and I 768 (6 iterations a slot: the loads' refill and a partial last round); k = 10
    slots in 1 part (warps taking 3, 3, 2, 2 slots), 3 parts (4, 4, 2) and 4 (3, 3, 3, 1); k = 4 in 3 parts leaves
    the last part empty (zeros); in its forms (`cuda_raw`, `cuda_l2`, `cuda_wide`), bitwise equal to each other.
    Tolerance as the float16 forms': 2e-5 of max|ref| (float32 sums in another order of exact products) plus
    `_flip_atol`; and the path ran (its target is in the lowered module)."""
    ME, CU = _cuda_kernels_or_skip(gate_up=False, down=True)
    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, 1, routed_expert_hidden_size=1536, moe_intermediate_size=768,
                                   num_experts_per_token=k)
    assert ids.shape == (1, k)
    if layout == "joined":
        w = _joined(w)
    for cuda in (True, False):  # each kernel 1; kernel 2's forms (each slot's float16 copy made in the kernel is
        # f16_scaled's): the same bits
        forms = ((False, False, False), (True, False, False), (True, True, False), (False, False, True))
        _cuda_forms_agree((cfg, w, z, wk, ids),
                          [ME.Config(cuda=cuda, cuda_down=True, slot_splits=parts, cuda_raw=r, cuda_l2=l2, cuda_wide=wd)
                           for r, l2, wd in forms], lambda c: {CU.DOWN_TARGET: True})


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["checkpoint", "joined"])
@pytest.mark.parametrize("B,parts", [(2, 1), (5, 3), (8, 4)])
def test_moe_experts_cuda_wide_on_gpu(layout, B, parts):
    """The CUDA kernels for several tokens (`Config(cuda_wide=True)`: each token one of the mma's 8 columns, its
    float16 row read through L1), compiled: kernel 1 with the Pallas float16 kernel 2 and with the CUDA kernel 2, and
    the CUDA kernel 2 after the Pallas kernel 1, against the jnp reference; B = 2, 5, 8 tokens (5: the columns past
    B zeros; the slots padded with -1, which both kernels skip), 10 choices a token of 16 experts in 1, 3, 4 slot
    parts, an input of 1536 and I 768 (6 iterations a warp), the L2 hint on and off (the same bits).  Tolerance as the
    float16 forms': 2e-5 of max|ref| (float32 sums in another order of exact products), plus `_flip_atol` (the
    activations near a bf16 rounding tie, which another sum order may round the other way)."""
    ME, CU = _cuda_kernels_or_skip(gate_up=True, down=True)
    cfg, w, z, wk, ids = _moe_case("mxfp4", jnp.bfloat16, B, routed_expert_hidden_size=1536, moe_intermediate_size=768,
                                   num_experts_per_token=10)
    if layout == "joined":
        w = _joined(w)
    for cuda, cuda_down in ((True, False), (True, True), (False, True)):
        _cuda_forms_agree((cfg, w, z, wk, ids),
                          [ME.Config(cuda=cuda, cuda_down=cuda_down, cuda_wide=True, cuda_l2=l2, slot_splits=parts)
                           for l2 in (False, True)], lambda c: {CU.TARGET: c.cuda, CU.DOWN_TARGET: c.cuda_down})


def test_moe_residual_is_the_stream_add():
    """The MoE block handed the residual stream (`moe(..., residual=h)`, as the Kimi-Linear decode step calls it)
    returns the stream's add and rounding of its output, bit for bit: the block without it plus h in float32, rounded
    to bf16, as `attn_res.ffn_done` computes it; on the CPU path and through the Pallas kernels in interpret mode
    (`moe_experts.experts`, its two return paths' add)."""
    from jaxk3.kernels import moe_experts as ME
    from jaxk3.layers import moe

    cfg, w, z, wk, ids = _moe_case("dense", jnp.bfloat16, 2)
    h = jnp.asarray(np.random.default_rng(1).standard_normal((2, z.shape[1])), jnp.bfloat16)
    c = ME.Config(bn=16, bk=32, splits=2)
    y = ME.experts(cfg, w, z, wk, ids, interpret=True, config=c)
    added = ME.experts(cfg, w, z, wk, ids, interpret=True, config=c, residual=h)
    assert added.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(added).view(np.uint16),
                                  np.asarray((h + y).astype(jnp.bfloat16)).view(np.uint16))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, cfg.hidden_size)), jnp.bfloat16)
    hx = jnp.asarray(np.random.default_rng(3).standard_normal((2, cfg.hidden_size)), jnp.bfloat16)
    f = jax.jit(lambda x: moe.moe(cfg, w, x, None))(x)
    g = jax.jit(lambda x, h: moe.moe(cfg, w, x, None, residual=h))(x, hx)
    np.testing.assert_array_equal(np.asarray(g).view(np.uint16),
                                  np.asarray((hx + f).astype(jnp.bfloat16)).view(np.uint16))


@pytest.mark.parametrize("routed", [False, True])
def test_moe_residual_added_in_kernel_2(monkeypatch, routed):
    """With RESIDUAL_IN_DOWN, kernel 2 adds the residual stream and rounds it itself (one token, bf16 experts, the
    shared experts fused: the 48B's serving form; `experts` and the routed form): its output is bf16 from the
    kernel (no partial sums left for XLA), bit for bit bf16(h + y) where y is the kernel's own float32 sum at the
    tiling `_fold_config` gives (one part along I, 4-row programs here, tiles of up to FOLD_BK columns), and within
    the experts tests' 2e-6 (float32 reassociation) of the jnp reference before the one rounding.  A kernel 2 that
    skipped the add, or added a row of h shifted by one program, fails the bitwise check.  Not where it cannot
    fold: more than one token, MXFP4 experts, an explicit split of I (kernel 2's float32 partial sums, XLA's add).
    Compiled for the H200 by tests/test_aot.py (the 48B step with it), on the GPU by
    test_moe_residual_in_kernel_2_on_gpu, and timed in the step (docs/PERF.md, thirty-fifth session)."""
    from jaxk3.kernels import moe_experts as ME

    cfg, w, z, logits, bias = _routed_case("dense", jnp.bfloat16, ties=False)
    w = _joined(w)
    shared = _shared(w, jnp.bfloat16)
    from jaxk3.kernels.router import select_experts

    wk, ids = select_experts(cfg, logits, bias)
    L, I = w.experts_w2.shape[1:]
    h = jnp.asarray(np.random.default_rng(4).standard_normal((1, L)), jnp.bfloat16)
    c = ME.Config(bn=16, bk=32)
    monkeypatch.setattr(ME, "RESIDUAL_IN_DOWN", True)
    fc = ME._fold_config(ME._resolve(c, 1, z.shape[1], I, L), 1, False, h, L, I)
    assert fc.splits == 1 and fc.down_bn == 4 and fc.down_bk == min(ME.FOLD_BK, I), fc  # (tiny L: fewer than 4 an SM)

    def run(residual, config):
        if routed:
            return ME.experts_routed(cfg, w, z, logits, bias, shared=shared, interpret=True, config=config,
                                     residual=residual)
        return ME.experts(cfg, w, z, wk, ids, shared=shared, interpret=True, config=config, residual=residual)

    assert ME.fits(cfg, w, z, wk, ids, shared=shared, config=c, only_where_faster=False, residual=h) is None
    f = jax.jit(lambda h: run(h, c))

    def down_out():  # kernel 2's output (dtype, shape), traced anew (RESIDUAL_IN_DOWN is read at trace time)
        eqns = [e for e in jax.make_jaxpr(lambda h: run(h, c))(h).eqns if e.primitive.name == "pallas_call"]
        assert len(eqns) == 2, eqns
        (v,) = eqns[1].outvars
        return v.aval.dtype, v.aval.shape

    assert down_out() == (jnp.bfloat16, (1, 1, L))
    got = np.asarray(f(h))
    y = run(None, ME.Config(bn=16, bk=32, splits=1, down_bn=fc.down_bn, down_bk=fc.down_bk))  # the same sums, no add
    assert got.dtype == np.dtype(jnp.bfloat16) and got.shape == (1, L)
    want = np.asarray((h + y).astype(jnp.bfloat16))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    ref = np.asarray(ME.reference(cfg, w, z, wk, ids, shared=shared))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    shifted = np.asarray((jnp.roll(h, 4, axis=1) + y).astype(jnp.bfloat16))
    assert (shifted.view(np.uint16) != got.view(np.uint16)).mean() > 0.5
    # off, and where it cannot fold (an explicit split of I): the partial sums and XLA's add, as before
    monkeypatch.setattr(ME, "RESIDUAL_IN_DOWN", False)
    assert down_out() == (jnp.float32, (ME._splits(ME._resolve(c, 1, z.shape[1], I, L), L, I), 1, L))
    monkeypatch.setattr(ME, "RESIDUAL_IN_DOWN", True)
    assert ME._fold_config(ME._resolve(ME.Config(bn=16, bk=32, splits=2), 1, z.shape[1], I, L), 1, False, h, L,
                           I) is None
    for fmt, B in (("dense", 2), ("mxfp4", 1)):  # more tokens; MXFP4 (kernel 2 in 4 slot parts at one token)
        c2, w2, z2, wk2, ids2 = _moe_case(fmt, jnp.bfloat16, B)
        h2 = jnp.ones((B, w2.experts_w2.shape[1] if fmt == "dense" else c2.moe_hidden), jnp.bfloat16)
        eqns = [e for e in jax.make_jaxpr(lambda h: ME.experts(c2, w2, z2, wk2, ids2, interpret=True, config=c,
                                                                residual=h))(h2).eqns if e.primitive.name == "pallas_call"]
        assert eqns[-1].outvars[0].aval.dtype == jnp.float32, (fmt, B)
    bad = ME.fits(cfg, w, z, wk, ids, shared=shared, config=ME.Config(bn=16, bk=32, down_bn=2), only_where_faster=False)
    assert "down_bn" in bad and ">= 4" in bad
    bad = ME.fits(cfg, w, z, wk, ids, shared=shared, config=ME.Config(bn=16, bk=32, down_bk=48),
                  only_where_faster=False)
    assert "down_bk" in bad


@pytest.mark.gpu
@pytest.mark.parametrize("E", [64, 256])
def test_moe_residual_in_kernel_2_on_gpu(monkeypatch, E):
    """RESIDUAL_IN_DOWN compiled at Kimi-Linear-48B's dims (E experts, the serving layout with the shared experts
    fused, one token; `_fold_config`: kernel 2 in 576 programs of 4 rows over L 2304, I 1024 in one tile), through
    the routed form as the step calls it and through `experts`: bit for bit bf16(h + y), y the same kernels' float32
    sum at that tiling without the add; y within 2e-6 of max|y| of the default tiling's (float32 reassociation, as
    test_moe_experts_routed_matches_reference bounds it), so the new stream is within one bf16 rounding of the
    unfused path's."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from jaxk3.kernels import moe_experts as ME
    from jaxk3.kernels.router import select_experts

    cfg, w, z, logits, bias, shared = _routed_real(E, seed=13)
    wk, ids = select_experts(cfg, logits, bias)
    L, I = cfg.hidden_size, cfg.moe_intermediate_size
    h = jnp.asarray(np.random.default_rng(13).standard_normal((1, L)), jnp.bfloat16)
    monkeypatch.setattr(ME, "RESIDUAL_IN_DOWN", True)
    fc = ME._fold_config(ME._resolve(ME.Config(), 1, L, I, L), 1, False, h, L, I)
    assert (fc.splits, fc.down_bn, fc.down_bk) == (1, 4, 1024), fc
    tiled = ME.Config(splits=1, down_bn=fc.down_bn, down_bk=fc.down_bk)
    y = np.asarray(jax.jit(lambda w, s, *a: ME.experts(cfg, w, *a, shared=s, config=tiled))(w, shared, z, wk, ids))
    y0 = np.asarray(jax.jit(lambda w, s, *a: ME.experts(cfg, w, *a, shared=s))(w, shared, z, wk, ids))
    np.testing.assert_allclose(y, y0, rtol=0, atol=2e-6 * np.abs(y0).max())
    yr = np.asarray(jax.jit(lambda w, s: ME.experts_routed(cfg, w, z, logits, bias, shared=s, config=tiled))(w, shared))
    for name, f, y in (
            ("routed", lambda w, s, h: ME.experts_routed(cfg, w, z, logits, bias, shared=s, residual=h), yr),
            ("ids", lambda w, s, h: ME.experts(cfg, w, z, wk, ids, shared=s, residual=h), y)):
        got = np.asarray(jax.jit(f)(w, shared, h))
        assert got.dtype == np.dtype(jnp.bfloat16) and got.shape == (1, L), name
        want = np.asarray((h + y).astype(jnp.bfloat16)).view(np.uint16)  # (each form's own weights: renormalised alike)
        np.testing.assert_array_equal(got.view(np.uint16), want, err_msg=name)


class _LazyExperts(dict):
    """The MoE block's HF-named weights for tests/refs/np_ref.moe, each expert's matrix sliced from the bf16 stacks
    when the reference reads it (it reads only the selected experts'): no float64 copy of all 64."""

    def __init__(self, m: str, stacks: dict, I: int):
        super().__init__()
        self.m, self.stacks, self.I = m, stacks, I

    def __missing__(self, key: str):
        e, name = key[len(self.m) + len("experts."):].split(".", 1)
        w13, w2 = self.stacks["w13"], self.stacks["w2"]
        got = {"w1.weight": w13[int(e), : self.I], "w3.weight": w13[int(e), self.I:], "w2.weight": w2[int(e)]}[name]
        return np.asarray(jnp.asarray(got, jnp.float32), np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("fold", [False, True])
def test_moe_block_paths_against_float64_on_gpu(monkeypatch, fold):
    """Kimi-Linear-48B's MoE block at one token (64 experts, the serving layout with the shared experts fused) through
    `layers.moe.moe` as the decode step calls it (a `Normed` input, under shard_map on one device), in XLA (kernels
    off) and through the Pallas kernels (auto), each against tests/refs/np_ref.moe in float64 on the same bf16 weights
    and the normed row XLA rounds to bf16: every path within 4e-3 of max|ref| (the other experts tests' bound: the bf16
    activations, rounded from float32 sums).  Handed the residual stream, each path's output is bf16(h + its output)
    bit for bit with the add after the kernels (moe_experts.RESIDUAL_IN_DOWN off); with kernel 2 adding it (`fold`, the
    step's path at one token) the Pallas path's new stream sums in one part along I, its own float32 order, so it is
    within one bf16 step of bf16(h + its output) (test_moe_residual_in_kernel_2_on_gpu checks it bit for bit against
    its own tiling's sum) and within 4e-3 of max|ref| plus that step of bf16(h + the float64 block)."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from jaxk3.kernels import moe_experts as ME

    monkeypatch.setattr(ME, "RESIDUAL_IN_DOWN", fold)
    from jaxk3 import collectives
    from jaxk3.layers import moe
    from jaxk3.layers.common import TP, Normed
    from refs import np_ref
    from jax.sharding import Mesh, PartitionSpec as P

    E = 64
    cfg, w, _, _, _, fused = _routed_real(E, seed=11)  # the experts and the shared experts' stacks
    D, I, Is = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    assert fused.gate_up.shape == (2 * Is, D)  # (one shared expert of the routed experts' width)
    r = np.random.default_rng(11)
    shared = moe.MLPWeights(gate_proj=None, up_proj=None, down_proj=fused.down, gate_up_proj=fused.gate_up)
    gate = (jax.random.normal(jax.random.key(12), (E, D), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
    w = dataclasses.replace(w, gate=gate, e_score_correction_bias=jnp.asarray(0.1 * r.standard_normal(E), jnp.float32),
                            shared_experts=shared)
    h = jnp.asarray(r.standard_normal((1, D)), jnp.bfloat16)
    g = jnp.asarray(r.uniform(0.5, 1.5, D), jnp.bfloat16)
    eps = cfg.rms_norm_eps
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))

    def block(kernels_mode: str, residual: bool):
        def f(w, h, g):
            return moe.moe(cfg, w, Normed(h, g, eps), TP("tp", kernels=kernels_mode), residual=h if residual else None)
        sm = collectives.shard_map(f, mesh=mesh, in_specs=(jax.tree.map(lambda _: P(), w), P(), P()), out_specs=P(),
                                   check_vma=False)
        return jax.jit(sm)

    paths = {"xla": "off", "pallas": "auto"}
    got, added, texts = {}, {}, {}
    for name, mode in paths.items():
        f, fr = block(mode, False), block(mode, True)
        texts[name] = fr.lower(w, h, g).as_text()
        got[name] = np.asarray(f(w, h, g), np.float32)
        added[name] = np.asarray(fr(w, h, g))
        want = np.asarray((h + jnp.asarray(got[name])).astype(jnp.bfloat16))
        if fold and name == "pallas":  # within one bf16 step (2^-7 of the value's binade) of the unfused add
            a32, w32 = added[name].astype(np.float32), want.astype(np.float32)
            step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(w32), 1e-30))) - 7)
            assert (np.abs(a32 - w32) <= step).all() and (a32 != w32).mean() < 0.01, name
        else:
            np.testing.assert_array_equal(added[name].view(np.uint16), want.view(np.uint16), err_msg=name)
    assert "triton" in texts["pallas"] and "triton" not in texts["xla"]

    # the float64 block on the normed row as XLA rounds it (what every path's experts read)
    from jaxk3.kernels.rms_norm import rms_norm_as
    xn = np.asarray(jnp.asarray(jax.jit(lambda h, g: rms_norm_as(h, g, eps))(h, g), jnp.float32), np.float64)[0]
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    m = "model.layers.1.block_sparse_moe."
    W = _LazyExperts(m, {"w13": w.experts_w13, "w2": w.experts_w2}, I)
    W.update({m + "gate.weight": f64(w.gate), m + "gate.e_score_correction_bias": f64(w.e_score_correction_bias),
              m + "shared_experts.gate_proj.weight": f64(shared.gate_up_proj[:Is]),
              m + "shared_experts.up_proj.weight": f64(shared.gate_up_proj[Is:]),
              m + "shared_experts.down_proj.weight": f64(shared.down_proj)})
    ref = np_ref.moe(np_ref.Config(cfg.to_hf_dict()), W, m, xn)
    scale = np.abs(ref).max()
    err = {k: float(np.abs(v[0] - ref).max() / scale) for k, v in got.items()}
    print("moe block, max|path - float64| / max|float64|:", {k: f"{v:.2e}" for k, v in err.items()})
    for k, v in err.items():
        assert v <= 4e-3, (k, err)
    new64 = np.asarray(h, np.float32).astype(np.float64)[0] + ref  # the new stream in float64
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(new64), 1e-30))) - 7)
    for k, a in added.items():
        assert (np.abs(a.astype(np.float32)[0] - new64) <= 4e-3 * scale + step).all(), k
