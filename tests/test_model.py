"""The whole decode step and `Model.generate` on the tiny configs (docs/SPEC.md §7.1).

Tolerances
- float32 model vs float64 NumPy reference (test_*_matches_numpy_reference): max|Δlogit| <=
  1e-4 · max|logit|.  Same argument as tests/test_layers.py, over 8 layers: the observed error is
  <= 6e-7 relative; a real mistake moves logits by >= 1e-2.
- bfloat16 across TP sizes (test_tp_sizes_agree): tokens equal and max|Δlogit| <= 2e-2 · max|logit|.
  bf16 keeps 8 significant bits (one ulp = 0.4-0.8 %).  Changing TP changes the GEMM splits and the
  psum order of every row-parallel partial, so a stored bf16 activation can round to a neighbouring
  value at any of the ~40 rounding points of a step and the AttnRes / residual sums carry it to the
  logits; we observe 0.65 % of the largest logit (one-two ulps of a logit), so 2 % is a 3x margin
  that still fails for any sharding mistake (those give O(1) changes).  The tiny configs' greedy
  top-2 logit gaps are >= 0.02-0.09 on these prompts, far above the observed drift, so the tokens
  must agree exactly.  These bf16 runs (and the FFI-vs-lax one) use the tiny K3's first four layers
  (tests/small_models.py: every layer kind, each sharded the same way as in eight layers, at less
  compile time): there the drift is <= 0.25 % of the largest logit and the smallest top-2 gap 0.0136
  (0.34 %), which no TP moves by more than 11 % of itself (jax 0.10.2 and 0.12, measured 2026-12-01).
- FFI vs lax gathers: bitwise (the gathers are bitwise equal to lax.all_gather, so the whole
  program is identical).
- ragged batch vs solo rows, float32: tokens equal, logits within 1e-5 · max|logit| (rows are
  computed independently; only GEMM blocking for B=3 vs B=1 may round differently).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxk3
from jaxk3.config import KimiK3Config
from jaxk3.checkpoint import weights_from_hf
from jaxk3.engine import Model
from jaxk3.model import random_hf_weights
from refs import np_ref
from small_models import tiny_k3_4l

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 84, 59, 4]]
NEW = 6


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


@pytest.fixture(scope="module")
def k3_f32():
    return jaxk3.init_random_model(KimiK3Config.tiny_k3(), seed=0, tp=1, dtype="float32")


BF16_KEYS = ((1, "auto", True), (2, "auto", True), (4, "auto", True), (4, "auto", False), (8, "lax", True))


class _Runs(dict):
    """Greedy runs of the tiny K3's first four layers in bf16 under a TP size and switches, (tp, gather,
    shard_latent) -> GenerateOutput, each made when first asked for (one compile each)."""

    def __missing__(self, key):
        tp, gather, latent = key
        m = jaxk3.init_random_model(tiny_k3_4l(), seed=0, tp=tp, gather=gather, shard_latent=latent)
        self[key] = m.generate(PROMPTS, NEW, return_logits=True)
        return self[key]


@pytest.fixture(scope="module")
def bf16_runs():
    return _Runs()


# ------------------------------------------------------------------------ vs reference
def _reference_run(cfg, weights, prompt, tokens):
    ref = np_ref.RefModel(cfg.to_hf_dict(), weights)
    logits = None
    for t in prompt:
        logits = ref.step(t)
    out = [logits]
    for t in tokens[:-1]:
        out.append(ref.step(int(t)))
    return np.stack(out)


@pytest.mark.parametrize("mode", ["k3", "kl"])
def test_matches_numpy_reference(mode, k3_f32):
    cfg = KimiK3Config.tiny_k3() if mode == "k3" else KimiK3Config.tiny_kimi_linear()
    model = k3_f32 if mode == "k3" else jaxk3.init_random_model(cfg, seed=0, tp=1, dtype="float32")
    prompt = PROMPTS[0][:5]
    out = model.generate([prompt], 4, return_logits=True)
    assert out.tokens.shape == (1, 4) and out.logits.shape == (1, 4, cfg.vocab_size)
    assert out.tokens.dtype == np.int32 and out.logits.dtype == np.float32
    ref = _reference_run(cfg, random_hf_weights(cfg, 0), prompt, out.tokens[0])
    assert rel_err(out.logits[0], ref) <= 1e-4
    np.testing.assert_array_equal(out.tokens[0], ref.argmax(-1))


# ------------------------------------------------------------------------- TP, switches
def step_errors(a, b):
    """max|Δlogit| / max|logit| of every (row, step)."""
    return np.max(np.abs(np.asarray(a, np.float64) - b), axis=-1) / np.max(np.abs(np.asarray(b, np.float64)))


@pytest.mark.slow  # the first suite only: five bf16 models (100 s of compiling on the CI machine), while the
# newest jax meets every TP size in test_golden (8 layers: tokens and digests), test_generation and
# test_bitwise_paths
def test_tp_sizes_agree(bf16_runs):
    """Tokens equal; most (row, step) logits within 2e-2 (bf16 drift, see the module docstring).  A
    step whose router meets a near-tie may select another expert under another TP split (the
    partial sums round differently): that step's logits move by about one expert's share (seen:
    0.12 at one of 12 steps), so single steps may reach 0.25, while the median stays at drift."""
    base = bf16_runs[(1, "auto", True)]
    for key in BF16_KEYS:
        run = bf16_runs[key]
        np.testing.assert_array_equal(run.tokens, base.tokens, err_msg=str(key))
        err = step_errors(run.logits, base.logits)
        assert np.median(err) <= 2e-2 and np.max(err) <= 0.25 and np.mean(err > 2e-2) <= 0.2, (key, err)


# The first suite only (`slow`), as the next test: FFI vs lax bits on jax 0.12 are test_bitwise_paths' subject
# (every TP, both latents, decode and prefill).
@pytest.mark.slow
def test_ffi_and_lax_gathers_bitwise_equal(bf16_runs):
    m = jaxk3.init_random_model(tiny_k3_4l(), seed=0, tp=8, gather="ffi")
    a, b = m.generate(PROMPTS, NEW, return_logits=True), bf16_runs[(8, "lax", True)]
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logits, b.logits)


@pytest.mark.slow  # the first suite only: the newest jax runs both latent layouts in test_bitwise_paths and golden
def test_sharded_and_replicated_latent_agree(bf16_runs):
    a, b = bf16_runs[(4, "auto", True)], bf16_runs[(4, "auto", False)]
    np.testing.assert_array_equal(a.tokens, b.tokens)
    err = step_errors(a.logits, b.logits)
    assert np.median(err) <= 2e-2 and np.max(err) <= 0.25, err  # as test_tp_sizes_agree


def test_sharded_latent_lowers_to_one_gather_per_mla_layer():
    """shard_latent=True: one all-gather per MLA layer, one per latent MoE layer (z) and the logits
    gather; False: logits only."""
    cfg = KimiK3Config.tiny_k3()
    for latent, want in ((True, len(cfg.mla_layers) + cfg.layer_ffn.count("moe") + 1), (False, 1)):
        m = jaxk3.init_random_model(cfg, seed=0, tp=2, gather="lax", shard_latent=latent)
        c = m.init_cache(1, 64)
        hlo = m._step.lower(m.weights, c, np.zeros(1, np.int32), np.ones(1, bool)).as_text()
        assert hlo.count('"stablehlo.all_gather"') == want, latent


# ------------------------------------------------------------------------------ caches
def test_cache_is_updated(k3_f32):
    m = k3_f32
    tok = np.array([7], np.int32)
    c = m.init_cache(1, 64)
    l1, _, c = m.step(c, tok)
    assert int(c.length[0]) == 1
    for l, layer in enumerate(c.layers):  # KDA conv + state, MLA latents
        for a in jax.tree.leaves(layer):
            assert np.any(np.asarray(a)), l
    l2, _, c = m.step(c, tok)  # same token again: the state it sees is different
    assert int(c.length[0]) == 2
    assert rel_err(l2, l1) > 1e-2
    l1_again, _, _ = m.step(m.init_cache(1, 64), tok)  # a fresh first step reproduces the first one
    np.testing.assert_array_equal(np.asarray(l1_again), np.asarray(l1))


def test_pad_steps_leave_the_cache_alone(k3_f32):
    m = k3_f32
    c = m.init_cache(1, 64)
    _, _, c = m.step(c, [5], [False])
    assert int(c.length[0]) == 0
    for l, layer in enumerate(c.layers):
        for a in jax.tree.leaves(layer):
            assert not np.any(np.asarray(a)), l


def test_ring_conv_cache_generates_the_same(monkeypatch):
    """The KDA conv cache as the ring of K slots (kda_decode.RING, written in place) against the shift form:
    tiny Kimi-Linear at TP 2 (the ring split by channels), ragged prompts through a two-chunk prefill and
    the decode loop; the same tokens and logits, bitwise."""
    from jaxk3.kernels import kda_decode

    cfg = KimiK3Config.tiny_kimi_linear()
    monkeypatch.setattr(kda_decode, "RING", False)  # read where a model first lays out a cache: a new model
    m = jaxk3.init_random_model(cfg, seed=3, tp=2, dtype="float32")
    assert {x.conv.shape[-1] for x in m.init_cache(2, 64).layers if hasattr(x, "conv")} == {
        cfg.short_conv_kernel_size - 1}
    prompts = [list(np.random.default_rng(4).integers(1, cfg.vocab_size, 70)), [21, 22, 23]]  # two chunks of 64
    shift = m.generate(prompts, 5, return_logits=True, prefill_chunk=64)
    monkeypatch.setattr(kda_decode, "RING", True)
    m = jaxk3.init_random_model(cfg, seed=3, tp=2, dtype="float32")
    c = m.init_cache(2, 64)
    assert {x.conv.shape[-1] for x in c.layers if hasattr(x, "conv")} == {cfg.short_conv_kernel_size}
    ring = m.generate(prompts, 5, return_logits=True, prefill_chunk=64)
    assert {x.conv.shape[-1] for x in m.init_cache(*ring.tokens.shape[:1], 128).layers if hasattr(x, "conv")} == {
        cfg.short_conv_kernel_size}
    np.testing.assert_array_equal(ring.tokens, shift.tokens)
    np.testing.assert_array_equal(ring.logits, shift.logits)


@pytest.mark.slow  # the first suite only: on the newest jax, ragged left-padded rows through the prefill and the
# loop are test_generation's prompts, and test_pad_steps_leave_the_cache_alone checks the padding steps
def test_ragged_batch_equals_solo_rows(k3_f32):
    # a padded row between two full ones; rows of 5 and 2 tokens, so that each solo run's prompt length is
    # one compiled prefill (the 5-token one is test_matches_numpy_reference[k3]'s, as is the decode loop):
    # a third length, 7 (a second padded row), cost a prefill compile of its own (48 -> 39 CPU seconds),
    # and the pads are masked per row and step whatever their count
    prompts = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35]]
    batch = k3_f32.generate(prompts, 4, return_logits=True)
    for i, p in enumerate(prompts):
        solo = k3_f32.generate([p], 4, return_logits=True)
        np.testing.assert_array_equal(batch.tokens[i], solo.tokens[0])
        assert rel_err(batch.logits[i], solo.logits[0]) <= 1e-5


def test_int_array_prompts(k3_f32):
    # the prompt and token count of test_matches_numpy_reference[k3], so its compiled prefill and decode
    # loop serve these calls (a 2-token call compiled a decode loop of its own: 12 of this test's 12 CPU seconds)
    a = k3_f32.generate(np.array([PROMPTS[0][:5]]), 4, return_logits=True)
    b = k3_f32.generate([PROMPTS[0][:5]], 4, return_logits=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logits, b.logits)
    assert k3_f32.generate(np.array([PROMPTS[0][:5]]), 1).logits is None  # the same prefill; no decode loop


# --------------------------------------------------------------------- input validation
def test_bad_inputs_raise_before_compiling(k3_f32):
    cfg = KimiK3Config.tiny_k3()
    with pytest.raises(ValueError, match="not divisible by the TP size 3"):
        jaxk3.init_random_model(cfg, tp=3)
    with pytest.raises(ValueError, match="tp: must be an int"):
        jaxk3.init_random_model(cfg, tp=len(jax.devices()) + 1)
    with pytest.raises(ValueError, match="gather"):
        jaxk3.init_random_model(cfg, tp=1, gather="nccl")
    with pytest.raises(ValueError, match="dtype"):
        jaxk3.init_random_model(cfg, tp=1, dtype="int8")
    with pytest.raises(ValueError, match="outside"):
        k3_f32.generate([[1, 1000]], 2)
    with pytest.raises(ValueError, match="outside"):
        k3_f32.generate([[-1]], 2)
    with pytest.raises(ValueError, match="row 1 is empty"):
        k3_f32.generate([[1], []], 2)
    with pytest.raises(ValueError, match="empty batch"):
        k3_f32.generate([], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        k3_f32.generate([[1]], 0)


# ------------------------------------------------------------------- HF names / loading
def test_weights_load_by_hf_names():
    cfg = KimiK3Config.tiny_k3()
    W = random_hf_weights(cfg, 0)
    # K3 multimodal prefix, and A_log given as the checkpoint's [128] (only the first H are used)
    W2 = {("language_model." + k[len("model."):] if k.startswith("model.layers.") else k): v for k, v in W.items()}
    l = cfg.kda_layers[0]
    W2[f"language_model.layers.{l}.self_attn.A_log"] = np.concatenate(
        [W[f"model.layers.{l}.self_attn.A_log"], np.full(120, 99.0, np.float32)])
    a, b = weights_from_hf(cfg, W), weights_from_hf(cfg, W2)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    del W2["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing tensor '(language_model\.)?lm_head\.weight'"):
        weights_from_hf(cfg, W2)
    W[f"model.layers.{l}.self_attn.q_proj.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match="q_proj.weight"):
        weights_from_hf(cfg, W)


def test_from_weights_equals_init_random(k3_f32):
    cfg = KimiK3Config.tiny_k3()
    m = Model.from_weights(cfg, weights_from_hf(cfg, random_hf_weights(cfg, 0)), tp=1, dtype="float32")
    for x, y in zip(jax.tree.leaves(m.weights), jax.tree.leaves(k3_f32.weights)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # the first suite only: `make demo`'s job (two models' compiles); its generate calls, gathers
# and psums (auto and lax at TP 2) meet the newest jax in test_bitwise_paths and test_generation
def test_demo_runs_and_agrees(monkeypatch):
    """run_demo end to end on the tiny K3's first four layers (tests/small_models.py: every kind of layer, so
    every gather and psum site the demo compares; the demo's code does not depend on the depth, and its
    compiles cost half the 8-layer model's: 59 -> 32 CPU seconds).  Batch 2, prompt 8
    and 6 new tokens make its one-shot model's prefill test_tp_sizes_agree's TP-2 one (compiled once)."""
    from jaxk3.tools import demo

    cfg = tiny_k3_4l()
    monkeypatch.setattr(demo, "KimiK3Config", type("Tiny4", (), {"tiny_k3": staticmethod(lambda: cfg)}))
    r = demo.run_demo(tp=2, prompt_len=len(PROMPTS[0]), new_tokens=NEW, batch=len(PROMPTS), verbose=False)
    assert r["tokens_equal"] and len(r["tokens"]) == 2 and len(r["tokens"][0]) == NEW
    assert len(r["fast_step_ms"]) == len(r["lax_step_ms"]) == 3 and r["speedup"] > 0
