"""Misuse of the model API gives a named error, never a crash or silent garbage (issue 15's rows
that live in the model and the loader; the CLI's rows are in tests/test_cli*.py)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxk3
from jaxk3 import checkpoint as ck
from jaxk3 import mxfp4
from jaxk3.config import KimiK3Config
from jaxk3.engine import Model, NonFiniteLogitsError
from jaxk3.model import random_hf_weights


@pytest.fixture(scope="module")
def tiny():
    return jaxk3.init_random_model(KimiK3Config.tiny_k3(), seed=0, tp=1, dtype="float32")


def test_prompt_shapes_and_types_are_named(tiny):
    for bad, exc, match in (("123", TypeError, "string"), ([1, 2, 3], TypeError, r"row 0 is 1"),
                            ([[1.7, 2.2]], TypeError, "float"), ([[True, 2]], TypeError, "bool"),
                            (np.ones((1, 3), np.float32), ValueError, "integers"), (5, TypeError, "list of rows"),
                            ([["a"]], TypeError, "token ids are ints")):
        with pytest.raises(exc, match=match):
            tiny.generate(bad, 3)


def test_step_past_capacity_is_an_error(tiny):
    c = tiny.init_cache(1, 64)
    for _ in range(64):
        _, _, c = tiny.step(c, [7])
    assert int(c.length[0]) == 64
    with pytest.raises(ValueError, match="full: a row would hold 65 tokens in a cache of 64 slots"):
        tiny.step(c, [7])


def test_donated_cache_is_a_python_error(tiny):
    c = tiny.init_cache(1, 64)
    _, _, c2 = tiny.step(c, [7])
    with pytest.raises(ValueError, match="donated to an earlier step"):
        tiny.step(c, [7])
    tiny.step(c2, [7])  # the returned one works


def test_tp_accepts_numpy_integers():
    m = jaxk3.init_random_model(KimiK3Config.tiny_k3(), seed=0, tp=np.int64(2))
    assert m.tp == 2


def test_max_new_tokens_checked_against_positions_and_memory():
    import dataclasses

    cfg = KimiK3Config.tiny_k3()
    m = jaxk3.init_random_model(dataclasses.replace(cfg, max_position_embeddings=100), seed=0, tp=1)
    with pytest.raises(ValueError, match="prompt \\+ new tokens = 103 > max_position_embeddings 100"):
        m.generate([[1, 2, 3]], 100)
    with pytest.raises(ValueError, match="GiB per device"):
        jaxk3.init_random_model(cfg, seed=0, tp=1).generate([[1, 2, 3]], 10**12)


def test_nan_weights_are_named_at_load(tmp_path):
    cfg = KimiK3Config.tiny_k3()
    flat = random_hf_weights(cfg, 0)
    l = cfg.mla_layers[0]
    flat[f"model.layers.{l}.self_attn.q_b_proj.weight"][3, 5] = np.nan
    with pytest.raises(ck.NonFiniteTensorError, match=rf"layers\.{l}\.self_attn\.q_b_proj\.weight' holds nan"):
        Model.from_weights(cfg, flat, tp=2)
    flat = random_hf_weights(cfg, 0)
    flat["lm_head.weight"][17] = np.inf
    ck.save_checkpoint(tmp_path / "ck", cfg, flat)
    with pytest.raises(ck.NonFiniteTensorError, match="lm_head.weight' holds inf at model index \\[17, 0\\]"):
        jaxk3.load_model(str(tmp_path / "ck"), tp=1)
    m = jaxk3.load_model(str(tmp_path / "ck"), tp=1, check_finite=False, dtype="float32")  # opted out: loads
    with pytest.raises(NonFiniteLogitsError, match="not finite"):  # and generate says so instead of garbage
        m.generate([[1, 2]], 4)


def test_mxfp4_nan_scale_is_named(tmp_path):
    cfg = KimiK3Config.tiny_k3()
    flat = random_hf_weights(cfg, 0)
    rng = np.random.default_rng(0)
    base = "model.layers.1.block_sparse_moe.experts.2.w2"
    rows, cols = flat[base + ".weight"].shape
    scale = rng.integers(118, 126, (rows, cols // mxfp4.GROUP)).astype(np.uint8)
    scale[1, 0] = 255
    ck.save_checkpoint(tmp_path / "ck", cfg, flat, k3_layout=True, mxfp4_experts={
        base: (rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8), scale)})
    with pytest.raises(ck.NonFiniteTensorError, match=r"experts\.2\.w2\.weight_scale' holds the E8M0 scale byte 255"):
        jaxk3.load_model(str(tmp_path / "ck"), tp=1)
    assert jax.devices()[0].platform == "cpu"


def test_finite_check_on_the_bits():
    """The loader's NaN/Inf test reads exponent bits: right for bf16, f16, f32, f64, and blind to ints."""
    import ml_dtypes

    for dt in (ml_dtypes.bfloat16, np.float16, np.float32, np.float64):
        a = (np.random.default_rng(1).standard_normal((5, 7)) * 100).astype(dt)
        a[0, 0] = np.finfo(np.float16).max if dt == np.float16 else 1e30 if dt != np.float64 else 1e300
        assert ck._all_finite(a), dt
        for bad in (np.nan, np.inf, -np.inf):
            b = a.copy()
            b[3, 2] = bad
            assert not ck._all_finite(b), (dt, bad)
    assert ck._all_finite(np.full(4, 255, np.uint8))
