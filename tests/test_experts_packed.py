"""Issue 17 on CPU: MXFP4 experts kept packed on the device, and the MoE latent projections split
over TP (`shard_latent`).

Exactness.  A dequantised MXFP4 value is a 3-significant-bit number times a power of two, exact
in float32 and in bfloat16 (same exponent range), so the packed path (dequantised where it is
used) and the dequantise-at-load path multiply the same float32 values in the same fused
expressions: their logits are compared *bitwise*.  Splitting `routed_expert_up_proj` by its
input columns changes the order of a float32 sum (rank partials, then the psum), so sharded vs
replicated latents are compared in float32 within 1e-4 absolute on logits of magnitude ~1
(measured 7e-6: float32 reassociation through the 8 layers of the tiny model), with equal tokens.

The models are the tiny K3's first four layers (tests/small_models.py: KDA and MLA attention, the
dense MLP and three MoE layers): packing and latent splits are per MoE layer, so depth adds nothing
but compile time.  Where two tests run the same model and shapes (TP 2, bf16, these prompts, 5 new
tokens) they run the same programs, which the session's compilation cache compiles once.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxk3
from jaxk3 import checkpoint as ck
from jaxk3 import mxfp4, params
from jaxk3.config import KimiK3Config
from jaxk3.layers import moe
from jaxk3.engine import Model
from jaxk3.model import abstract_weights, random_hf_weights
from small_models import tiny_k3_4l

PROMPTS = [[5, 17, 900, 3, 44], [42, 7]]


def tiny(**kw) -> KimiK3Config:
    return tiny_k3_4l(**kw)


def packed_cfg(**kw) -> KimiK3Config:
    return dataclasses.replace(tiny(**kw), experts_format="mxfp4")


def dequantised(flat: dict) -> dict:
    """The same checkpoint with every MXFP4 expert dequantised (float32, exact)."""
    out = {}
    for k, v in flat.items():
        if k.endswith(".weight_packed"):
            base = k[: -len("_packed")]
            out[base] = mxfp4.dequantize(v, flat[base + "_scale"])
        elif not k.endswith(".weight_scale"):
            out[k] = v
    return out


@pytest.fixture(scope="module")
def packed_flat():
    return random_hf_weights(packed_cfg(), seed=3)


def test_jnp_dequantize_is_the_numpy_one_bit_for_bit():
    """Every code and every scale byte 0..254 (the NumPy one is checked against compressed-tensors).
    Scale byte 0 (2**-127) and the products of byte 1 below 2**-126 are float32 subnormals, which XLA
    flushes to zero (so does the dense path's arithmetic on the device); real scales sit near
    2**-10, so only those two bytes differ from NumPy, and only by the flush."""
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 255, 32), dtype=np.uint8)
    packed[0, 0, :16] = np.arange(16) * 17  # both nibbles through all 16 codes
    scale = np.broadcast_to(np.arange(255, dtype=np.uint8)[None, :, None], (3, 255, 2)).copy()
    got = np.asarray(jax.jit(moe.dequantize)(moe.MXFP4(jnp.asarray(packed), jnp.asarray(scale))))
    want = mxfp4.dequantize(packed, scale)
    np.testing.assert_array_equal(got[:, 2:], want[:, 2:])
    tiny = want[:, :2]
    flushed = (np.abs(tiny) < np.finfo(np.float32).tiny) | (np.arange(2)[None, :, None] == 0)
    np.testing.assert_array_equal(got[:, :2], np.where(flushed, 0 * tiny, tiny))
    assert moe.MXFP4(jnp.asarray(packed), jnp.asarray(scale)).shape == (3, 255, 64)


def test_random_packed_model_declares_uint8_experts():
    cfg = packed_cfg()
    w = abstract_weights(cfg).layers[1].ffn
    assert isinstance(w.experts_w2, moe.MXFP4)
    E, I, L = cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_hidden
    assert w.experts_w2.packed.shape == (E, L, I // 2) and w.experts_w2.scale.shape == (E, L, I // 32)
    assert w.experts_w1.packed.name == "model.layers.1.block_sparse_moe.experts.{e}.w1.weight_packed"
    flat = random_hf_weights(cfg, 0)
    s = flat["model.layers.1.block_sparse_moe.experts.3.w1.weight_scale"]
    assert s.dtype == np.uint8 and s.min() >= params.E8M0_RANGE["e8m0"][0] and s.max() < params.E8M0_RANGE["e8m0"][1]
    dense = mxfp4.dequantize(flat["model.layers.1.block_sparse_moe.experts.3.w1.weight_packed"], s)
    assert 0.01 < dense.std() < 0.05  # the dense init's scale (0.02), so activations stay comparable
    m = jaxk3.init_random_model(cfg, seed=0, tp=2)
    a = m.weights.layers[1].ffn.experts_w1.packed
    assert a.dtype == jnp.uint8 and a.shape == (E, I, L // 2) and a.sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
    out = m.generate(PROMPTS, 5, return_logits=True)  # test_packed_equals_dequantised_at_load_bitwise[2]'s programs
    assert np.all(np.isfinite(out.logits))


# TP 1 with the first suite only (`slow`): the newest jax meets the same packed and dense forms at TP 2
# (prefill, decode loop and step), and TP 1 adds the dequantised-arrays model, which is jax-independent.
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_packed_equals_dequantised_at_load_bitwise(packed_flat, tp):
    """Same checkpoint, experts packed on the device vs dequantised at load: the prefill, the decode
    loop and the single step all give the same tokens and bitwise-equal logits (bf16 model)."""
    cfg = tiny()
    packed = Model.from_weights(cfg, packed_flat, tp=tp, experts="auto")
    dense = Model.from_weights(cfg, packed_flat, tp=tp, experts="dense")
    assert packed.cfg.experts_format == "mxfp4" and dense.cfg.experts_format == "dense"
    assert isinstance(packed.weights.layers[1].ffn.experts_w3, moe.MXFP4)
    assert dense.weights.layers[1].ffn.experts_w3.dtype == jnp.bfloat16
    a = packed.generate(PROMPTS, 5, return_logits=True)
    b = dense.generate(PROMPTS, 5, return_logits=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logits, b.logits)
    if tp == 2:  # the token-by-token step too (the decode loop above runs the same step function)
        c = packed.generate(PROMPTS, 3, return_logits=True, step_by_step=True)
        d = dense.generate(PROMPTS, 3, return_logits=True, step_by_step=True)
        np.testing.assert_array_equal(c.logits, d.logits)
    else:  # and the dense-from-dequantised-arrays model (no MXFP4 anywhere) is the same model again
        ref = Model.from_weights(cfg, dequantised(packed_flat), tp=tp)
        np.testing.assert_array_equal(ref.generate(PROMPTS, 5, return_logits=True).logits, a.logits)


def test_load_keeps_mxfp4_and_holds_fewer_bytes(tmp_path, packed_flat):
    cfg = tiny()
    flat = dequantised(packed_flat)
    mx = {k[: -len(".weight_packed")]: (v, packed_flat[k[: -len("_packed")] + "_scale"])
          for k, v in packed_flat.items() if k.endswith(".weight_packed")}
    ck.save_checkpoint(tmp_path, cfg, {k: v for k, v in flat.items() if ".experts." not in k or "shared" in k},
                       k3_layout=True, mxfp4_experts=mx)
    packed = jaxk3.load_model(str(tmp_path), tp=2)  # experts="auto"
    dense = jaxk3.load_model(str(tmp_path), tp=2, experts="dense")
    assert packed.cfg.experts_format == "mxfp4"

    def expert_bytes(m):
        return sum(params.shard_bytes(a) for l in m.weights.layers if isinstance(l.ffn, moe.MoEWeights)
                   for a in jax.tree.leaves((l.ffn.experts_w1, l.ffn.experts_w2, l.ffn.experts_w3)))
    ratio = expert_bytes(dense) / expert_bytes(packed)
    assert ratio == pytest.approx(2 / (0.5 + 1 / 32))  # bf16 vs nibble + a byte per 32: 3.76x
    a, b = packed.generate(PROMPTS, 5, return_logits=True), dense.generate(PROMPTS, 5, return_logits=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logits, b.logits)


def test_experts_option_errors(tmp_path, packed_flat):
    cfg = tiny()
    dense_flat = random_hf_weights(cfg, 0)
    with pytest.raises(ck.UnsupportedConfigError, match=r"experts\.0\.w1\.weight' is a dense expert weight.*"
                                                           r"experts='dense'"):
        Model.from_weights(cfg, dense_flat, tp=1, experts="mxfp4")
    with pytest.raises(ValueError, match=r"experts: must be one of \('auto', 'mxfp4', 'dense'\), got 'fp4'"):
        Model.from_weights(cfg, packed_flat, tp=1, experts="fp4")
    # tiny K3's moe_intermediate_size 64 = 2 scale groups: TP 4 cannot split w2's groups
    with pytest.raises(ValueError, match=r"experts='mxfp4': moe_intermediate_size / 32 .* = 2 is not divisible by "
                                         r"the TP size 4"):
        Model.from_weights(cfg, packed_flat, tp=4, experts="mxfp4")
    m = Model.from_weights(cfg, packed_flat, tp=4, experts="auto")  # auto: dequantised at load instead
    assert m.cfg.experts_format == "dense"
    with pytest.raises(ValueError, match=r"moe_hidden\) = 48 is not a multiple of the MXFP4 group 32"):
        packed_cfg(routed_expert_hidden_size=48)


def test_load_marks_float16_exact_experts(packed_flat):
    """The loader checks the MXFP4 scales it read: all in `F16_SCALES` (the random checkpoint's) sets the config's
    `experts_f16` and every stack's `MXFP4.f16` (what the decode kernel's float16 form needs, declared alike in the
    step's weight specs, so the step compiles with them); one scale byte outside (each end) leaves both off; the
    dequantised model has neither.  Both load and decode to the same tokens (on a CPU the kernels do not run)."""
    from jaxk3.kernels.moe_experts import F16_SCALES

    m = Model.from_weights(tiny(), packed_flat, tp=2, experts="mxfp4")
    stacks = [l.ffn.experts_w2 for l in m.weights.layers if isinstance(l.ffn, moe.MoEWeights)]
    assert m.cfg.experts_f16 and stacks and all(s.f16 for s in stacks)
    assert "experts_f16" not in m.cfg.to_hf_dict()
    a = m.generate(PROMPTS, 3)
    for byte in (F16_SCALES[0] - 1, F16_SCALES[1] + 1):
        flat = dict(packed_flat)
        name = "model.layers.2.block_sparse_moe.experts.5.w3.weight_scale"
        flat[name] = flat[name].copy()
        flat[name][7, 1] = byte
        off = Model.from_weights(tiny(), flat, tp=2, experts="mxfp4")
        assert not off.cfg.experts_f16
        assert not any(l.ffn.experts_w1.f16 for l in off.weights.layers if isinstance(l.ffn, moe.MoEWeights))
        assert len(off.generate(PROMPTS, 3).tokens) == len(a.tokens)
    assert not Model.from_weights(tiny(), packed_flat, tp=2, experts="dense").cfg.experts_f16


def test_nan_scale_in_packed_mode_is_named(packed_flat):
    flat = dict(packed_flat)
    name = "model.layers.2.block_sparse_moe.experts.5.w3.weight_scale"
    flat[name] = flat[name].copy()
    flat[name][7, 1] = 255
    with pytest.raises(ck.NonFiniteTensorError, match=r"experts\.5\.w3\.weight_scale' holds the E8M0 scale byte 255 .* "
                                                      r"at \[7, 1\]"):
        Model.from_weights(tiny(), flat, tp=2, experts="mxfp4")


def test_random_packed_weights_on_devices():
    """The bench's device-side generator makes MXFP4 bytes too (uint8, sharded, scales in range).  It is
    given one MoE layer's tree (the packed experts beside the router, the latent and shared projections:
    each distinct weight shape is a compile of its own: the whole model's took 15 CPU seconds, this 6)."""
    from jaxk3.model import make_mesh

    cfg = packed_cfg()
    mesh = make_mesh(None, 2)
    ffn = params.random_on_devices(abstract_weights(cfg, 2).layers[1].ffn, mesh, jnp.bfloat16, cfg.hidden_size)
    s = ffn.experts_w2.scale
    assert s.dtype == jnp.uint8 and s.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
    lo, hi = params.E8M0_RANGE["e8m0"]
    assert lo <= int(np.asarray(s).min()) and int(np.asarray(s).max()) < hi
    p = np.asarray(ffn.experts_w2.packed)
    assert len(np.unique(p)) > 200  # every byte value in use, not a constant


# ------------------------------------------------------------------ the latent projections
def test_latent_projection_specs_and_bytes():
    cfg = KimiK3Config.tiny_k3()
    ffn = abstract_weights(cfg, 4).layers[1].ffn
    P = jax.sharding.PartitionSpec
    assert ffn.routed_expert_down_proj.pspec(True) == P("tp", None)
    assert ffn.routed_expert_up_proj.pspec(True) == P(None, "tp")
    assert ffn.routed_expert_down_proj.pspec(False) == ffn.routed_expert_up_proj.pspec(False) == P()
    assert ffn.gate.pspec(True) == P()  # the router stays replicated (docs/MODEL.md says why)
    sharded = jaxk3.init_random_model(cfg, tp=4)
    rep = jaxk3.init_random_model(cfg, tp=4, shard_latent=False)
    for m, div in ((sharded, 4), (rep, 1)):
        got = params.bytes_per_rank(m.abstract, m.weights, experts_touched=4, rows=1)["moe_latent"]
        n_moe = cfg.layer_ffn.count("moe")
        assert got == n_moe * 2 * cfg.moe_hidden * cfg.hidden_size * 2 // div


@pytest.mark.slow
def test_sharded_latent_projections_match_replicated():
    """TP 1/2/8, float32: split MoE (and MLA) latent projections at TP 2/8 and replicated ones at
    TP 2 give the TP-1 tokens; logits within 1e-4 (module docstring).  (The bf16 golden test checks
    the split default at TP 2/4/8 bitwise against its recorded digests.)"""
    cfg = tiny()
    flat = random_hf_weights(cfg, 1)
    ref = Model.from_weights(cfg, flat, tp=1, dtype="float32").generate(PROMPTS, 4, return_logits=True)
    for tp, shard in ((2, True), (8, True), (2, False)):  # TP 4: the golden and bitwise tests
        m = Model.from_weights(cfg, flat, tp=tp, dtype="float32", shard_latent=shard)
        out = m.generate(PROMPTS, 4, return_logits=True)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_allclose(out.logits, ref.logits, rtol=0, atol=1e-4)
