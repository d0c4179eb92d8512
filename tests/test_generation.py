"""Prefill and the decode loop on the device (jaxk3.generation) against the token-by-token path.

Tolerances (float32 models): prefill + loop vs token-by-token logits within 1e-4 · max|logit|.
The two compute the same functions in a different order (KDA in chunked form with a triangular
solve instead of T rank-1 updates, MLA over T queries at once, MoE as grouped GEMMs instead of
per-token GEMVs); observed differences are ~1e-6 relative; a wrong mask, slot or state hand-over
moves logits by >= 1e-2.  Tokens must be equal (greedy gaps of the tiny models are >= 1e-2).

The models are the tiny ones' first four layers (tests/small_models.py: KDA and MLA attention, the dense
MLP and the MoE, two AttnRes blocks in K3 mode): each chunked form and its state hand-over is per layer,
so the 8-layer models would only compile longer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxk3
from jaxk3 import collectives, generation
from jaxk3.config import KimiK3Config
from small_models import first_layers, tiny_k3_4l, tiny_kimi_linear_4l

# ragged, one longer than the 64-token prefill chunk (two chunks, the first all pads for row 1)
PROMPTS = [list(np.random.default_rng(0).integers(0, 1000, 70)), [2, 71, 82, 5, 9]]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models, mode, tp):
    if (mode, tp) not in models:
        cfg = tiny_k3_4l() if mode == "k3" else tiny_kimi_linear_4l()
        models[(mode, tp)] = jaxk3.init_random_model(cfg, seed=0, tp=tp, dtype="float32")
    return models[(mode, tp)]


# The newest-jax suite runs K3 at TP 8 and Kimi-Linear at TP 2 (`slow` on the others): each form and both
# model kinds with their collectives; TP 1's prefill and loop meet it in test_model's reference tests.
@pytest.mark.parametrize("mode, tp", [pytest.param("k3", 1, marks=pytest.mark.slow), ("k3", 8), ("kl", 2),
                                      pytest.param("kl", 4, marks=pytest.mark.slow)])
def test_prefill_and_loop_equal_token_by_token(models, mode, tp):
    m = _model(models, mode, tp)
    ref = m.generate(PROMPTS, 7, return_logits=True, step_by_step=True)
    got = m.generate(PROMPTS, 7, return_logits=True, prefill_chunk=64, decode_chunk=3)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    assert rel_err(got.logits, ref.logits) <= 1e-4
    assert got.prompt_tokens == 128 and list(got.lengths) == [7, 7]


def test_score_equals_decode_logits(models):
    """Model.score: logits at every position equal the logits of feeding the prompt token by token."""
    m = _model(models, "k3", 1)
    rows = [PROMPTS[1] + [11, 12], PROMPTS[1][:3]]
    sc = m.score(rows)
    assert sc.shape == (2, 7, 1000) and np.isnan(sc[1, 3:]).all()
    for i, r in enumerate(rows):
        cache = m.init_cache(1, 64)
        for t, tok in enumerate(r):
            logits, _, cache = m.step(cache, [tok])
            assert rel_err(sc[i, t], np.asarray(logits)[0]) <= 1e-4


@pytest.mark.parametrize("mode, tp", [("k3", 1), ("kl", 2)])
def test_score_through_pinned_slices_is_the_plain_copy(models, monkeypatch, mode, tp):
    """Model.score's logits reach the host through pinned host memory in slices (`host_slices`, placed by threads):
    with slices of one position (ragged rows, two prefill chunks, a slice crossing a row's start) the result is the
    one-piece copy's, bitwise, and the slices were taken (pinned host memory on the CPU devices too)."""
    from jaxk3 import engine, model

    m = _model(models, mode, tp)
    rows = [PROMPTS[1] + [11, 12], PROMPTS[1][:3]]
    monkeypatch.setattr(model, "HOST_SLICE_BYTES", 1 << 40)
    whole = m.score(rows, prefill_chunk=64)
    seen = []
    real = model.host_slices

    def counted(x, axis=1, max_bytes=None):
        for s0, s1, h in real(x, axis, max_bytes):
            seen.append((s0, s1, h.flags.writeable))
            yield s0, s1, h
    monkeypatch.setattr(model, "HOST_SLICE_BYTES", 1)
    monkeypatch.setattr(engine, "host_slices", counted)
    sliced = m.score(rows, prefill_chunk=64)
    np.testing.assert_array_equal(sliced, whole)
    assert len(seen) >= 7 and all(s1 - s0 == 1 for s0, s1, _ in seen), seen[:4]
    assert np.isnan(sliced[1, 3:]).all() and np.isfinite(sliced[0]).all()


@pytest.mark.parametrize("mode, tp", [("k3", 1), ("kl", 2)])
def test_score_can_leave_the_logits_on_the_devices(models, mode, tp):
    """Model.score(host=False): a jax.Array with the host path's values bitwise (ragged rows: each row's positions from
    the start, NaN after its end; two prefill chunks), and a clear error for a host that is not a bool."""
    m = _model(models, mode, tp)
    rows = [PROMPTS[1] + [11, 12], PROMPTS[1][:3]]
    on_host = m.score(rows, prefill_chunk=64)
    on_dev = m.score(rows, prefill_chunk=64, host=False)
    assert isinstance(on_dev, jax.Array) and on_dev.shape == on_host.shape == (2, 7, 1000)
    np.testing.assert_array_equal(np.asarray(on_dev), on_host)
    assert np.isnan(np.asarray(on_dev)[1, 3:]).all() and np.isfinite(np.asarray(on_dev)[0]).all()
    long = [PROMPTS[0], PROMPTS[1]]  # 70 tokens: two chunks of 64
    np.testing.assert_array_equal(np.asarray(m.score(long, prefill_chunk=64, host=False)), m.score(long, prefill_chunk=64))
    with pytest.raises(ValueError, match="host: must be True"):
        m.score(rows, host="no")


def test_score_on_the_devices_over_dp_is_never_whole_on_each_device():
    """score(host=False) on a (dp 2, tp 2) mesh: 3 rows (padded to 4 for dp) come back split over dp by vocabulary
    (rows do not divide), 4 rows split by rows; the values are the host path's, bitwise."""
    from jax.sharding import Mesh

    cfg = tiny_kimi_linear_4l()
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    m = jaxk3.init_random_model(cfg, seed=0, mesh=mesh, dtype="float32")
    for rows, spec in (([PROMPTS[1] + [11, 12], PROMPTS[1][:3], [7, 8]], (None, None, "dp")),
                       ([PROMPTS[1] + [11, 12], PROMPTS[1][:3], [7, 8], [1, 2, 3, 4]], ("dp",))):
        got = m.score(rows, host=False)
        assert tuple(got.sharding.spec) == spec, got.sharding
        assert max(s.data.nbytes for s in got.addressable_shards) * 2 == got.nbytes
        np.testing.assert_array_equal(np.asarray(got), m.score(rows))


def test_host_slices_cover_the_array():
    """`host_slices` along either axis: the slices tile the array and hold its values; a small array is one piece."""
    from jaxk3.model import host_slices

    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 10, 5)), jnp.float32)
    for axis in (0, 1):
        parts = list(host_slices(x, axis=axis, max_bytes=2 * x.nbytes // x.shape[axis]))
        assert [p[:2] for p in parts] == [(s, min(s + 2, x.shape[axis])) for s in range(0, x.shape[axis], 2)]
        np.testing.assert_array_equal(np.concatenate([p[2] for p in parts], axis=axis), np.asarray(x))
    assert [p[:2] for p in host_slices(x)] == [(0, 10)]


def test_threaded_fill_and_copy_cover_the_array():
    """`engine._fill` and `engine._copy` (score's first touch of its output and its placing of each slice) reach every
    row, for row counts below, at and past threads x min_rows and not a multiple of it."""
    from concurrent.futures import ThreadPoolExecutor

    from jaxk3.engine import _copy, _fill

    r = np.random.default_rng(0)
    with ThreadPoolExecutor(3) as pool:
        for n in (1, 15, 16, 47, 48, 101):
            a = np.zeros((n, 7), np.float32)
            _fill(pool, 3, a, np.nan)
            assert np.isnan(a).all()
            src = r.standard_normal((n, 7)).astype(np.float32)
            _copy(pool, 3, a, src)
            np.testing.assert_array_equal(a, src)


def test_streaming_and_stop_ids(models):
    m = _model(models, "k3", 1)
    base = m.generate(PROMPTS, 9, decode_chunk=4)
    stop = int(base.tokens[0, 3])  # row 0 meets it at its 4th token
    chunks = []
    got = m.generate(PROMPTS, 9, decode_chunk=4, stop_ids=[stop], on_tokens=lambda t: chunks.append(t.copy()))
    first_hit = [int(np.argmax(base.tokens[i] == stop)) if (base.tokens[i] == stop).any() else None for i in range(2)]
    for i in range(2):
        if first_hit[i] is None:
            np.testing.assert_array_equal(got.tokens[i], base.tokens[i])  # a running row is unaffected
            assert got.lengths[i] == 9
        else:
            n = first_hit[i] + 1
            np.testing.assert_array_equal(got.tokens[i, :n], base.tokens[i, :n])
            assert (got.tokens[i, n:] == -1).all() and got.lengths[i] == n  # frozen: pad id (-1: none in cfg)
    streamed = np.concatenate(chunks, axis=1)
    np.testing.assert_array_equal(streamed, got.tokens[:, :streamed.shape[1]])
    assert chunks[0].shape == (2, 1)


def test_sampling_reproducible_and_within_top_k(models):
    m = _model(models, "kl", 2)
    kw = dict(temperature=1.0, top_k=3, seed=7, decode_chunk=4)
    a, b = m.generate(PROMPTS, 8, return_logits=True, **kw), m.generate(PROMPTS, 8, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)  # same seed, same tokens
    c = m.generate(PROMPTS, 8, **dict(kw, seed=8))
    assert not np.array_equal(a.tokens, c.tokens)
    top3 = np.argsort(a.logits, axis=-1)[..., -3:]
    assert all(a.tokens[i, t] in top3[i, t] for i in range(2) for t in range(8))  # never outside the k


def test_sample_distribution():
    """Temperature 1, no limits: draw frequencies follow softmax(logits) (4000 draws, 6 sigma);
    top_p keeps the smallest prefix of the sorted distribution whose mass reaches p."""
    logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0, -3.0]])
    p = np.asarray(jax.nn.softmax(logits[0]))
    s = generation.Sampling(temperature=1.0)
    draws = np.asarray(jax.vmap(lambda i: generation.sample(logits, i, s))(jnp.arange(4000)))[:, 0]
    freq = np.bincount(draws, minlength=5) / 4000
    assert np.all(np.abs(freq - p) <= 6 * np.sqrt(p * (1 - p) / 4000) + 1e-3), (freq, p)
    s = generation.Sampling(temperature=1.0, top_p=0.8)  # p ≈ [.61, .22, .14, ...]: keeps {0, 1}
    draws = np.asarray(jax.vmap(lambda i: generation.sample(logits, i, s))(jnp.arange(2000)))[:, 0]
    assert set(draws.tolist()) == {0, 1}
    assert np.asarray(generation.sample(logits, 0, generation.Sampling())).tolist() == [0]  # greedy


def test_seeds_are_64_bits_never_wrapped():
    """Seeds that the old 32-bit key made equal (0 / 2**32; -1 / 2**32-1 / 2**63-1) now draw
    differently (16 draws over 4096 tokens each: a chance collision is ~4096**-16); seeds below 2**32
    keep jax.random.key(seed)'s draws; what is not a 64-bit unsigned int is refused by name."""
    logits = jax.random.normal(jax.random.key(3), (1, 4096))
    seeds = (0, 2**32, 2**32 - 1, 2**63 - 1, 2**64 - 1, 5, 5 + 2**32)
    draws = {}
    for seed in seeds:
        s = generation.Sampling(temperature=1.0, seed=seed)
        draws[seed] = tuple(np.asarray(jax.vmap(lambda i: generation.sample(logits, i, s))(jnp.arange(16)))[:, 0])
    assert len(set(draws.values())) == len(seeds), draws
    for seed in (0, 7, 2**32 - 1):
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(generation.Sampling(1.0, seed=seed).key())),
                                      np.asarray(jax.random.key_data(jax.random.key(seed))))
    assert generation.Sampling(1.0, seed=np.int64(9)).seed == 9
    for bad in (-1, 2**64, 2**70, 1.5, True, "3"):
        with pytest.raises(ValueError, match="seed"):
            generation.Sampling(temperature=1.0, seed=bad)


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-45, 1e-300])
def test_tiny_temperatures_sample_the_best_token(temperature):
    """A temperature so small that logits / T overflows float32 (or T itself is subnormal or 0 in
    float32) samples the argmax, never token 0 from a row of infinities: below the smallest normal
    float32 it is greedy by definition, above it the logits are shifted by their maximum first."""
    logits = jax.random.normal(jax.random.key(1), (4, 1000)) * 3.0
    s = generation.Sampling(temperature=temperature, seed=4)
    assert s.greedy == (temperature < generation.MIN_TEMPERATURE)
    got = np.asarray(jax.vmap(lambda i: generation.sample(logits, i, s))(jnp.arange(8)))
    want = np.asarray(jnp.argmax(logits, axis=-1))
    assert (got == want[None]).all() and (want != 0).any(), (got, want)


def test_tiny_temperature_generates_the_greedy_tokens(models):
    m = _model(models, "k3", 1)
    greedy = m.generate(PROMPTS, 5).tokens
    for t in (1e-38, 1e-300):
        np.testing.assert_array_equal(m.generate(PROMPTS, 5, temperature=t, seed=2**40).tokens, greedy)


def test_bad_sampling_arguments(models):
    m = _model(models, "k3", 1)
    for kw, match in ((dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p"),
                      (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"), (dict(temperature=float("nan")), "temperature"),
                      (dict(prefill_chunk=100), "prefill_chunk"), (dict(decode_chunk=0), "decode_chunk"),
                      (dict(stop_ids=[5000]), "stop_ids"), (dict(temperature=0.5, step_by_step=True), "greedily")):
        with pytest.raises(ValueError, match=match):
            m.generate([[1, 2]], 2, **kw)


def test_prefill_gathers_take_the_fallback():
    """Prefill-sized gathers (more rows than JAXK3_GATHER_MAX_ROWS) fall back to lax, by plan."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("tp",))
    cfg = KimiK3Config.tiny_k3()
    w = (cfg.q_lora_rank + cfg.latent_dim) // 4
    p = collectives.explain(jax.ShapeDtypeStruct((2 * 64, w), jnp.float32), "tp", axis=-1, tiled=True,
                            padded=True, mesh=mesh)
    assert p.path == "lax" and "rows" in p.reason
    m = jaxk3.init_random_model(cfg, seed=0, tp=4, dtype="float32")
    from jaxk3.model import StepOptions, put_rows

    fn = generation.build_prefill(cfg, StepOptions(), m.mesh, all_logits=False)
    toks = np.ones((2, 64), np.int32)
    hlo = fn.lower(m.weights, m.init_cache(2, 64), put_rows(toks, m.mesh), put_rows(toks > 0, m.mesh),
                   np.int32(0)).as_text()
    # the latent gathers of 2 x 64 rows (MLA, and the latent MoE's z) fall back; the last position's
    # logits (2 rows) stay one-shot
    assert hlo.count('"stablehlo.all_gather"') == len(cfg.mla_layers) + cfg.layer_ffn.count("moe")
    assert hlo.count("jaxk3_padded_all_gather") + hlo.count("jaxk3_one_shot_all_gather") >= 1


def test_one_compile_per_bucket():
    """Every chunk of a call, and calls whose prompt + new tokens fall in one cache bucket, reuse one
    compiled prefill, one compiled decode loop and one compiled cache constructor (a recompile would cost
    seconds per call at real size)."""
    # a config no other test uses: the compiled functions are cached per (config, options, mesh), and
    # another test's dtype would add its own compile to the same cache
    cfg = first_layers(KimiK3Config.tiny_k3(max_position_embeddings=65432))
    m = jaxk3.init_random_model(cfg, seed=0, tp=2, shard_latent=False)
    m.generate(PROMPTS, 10, decode_chunk=3, prefill_chunk=64)
    m.generate(PROMPTS, 20, decode_chunk=3, prefill_chunk=64)
    assert {k[0]: f._cache_size() for k, f in m._fns.items()} == {"prefill": 1, "loop": 1, "cache": 1}
