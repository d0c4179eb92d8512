"""Every block (float32, one device and under shard_map) against the float64 NumPy reference.

Tolerance: |jax - ref| <= RTOL · max|ref| (+ a tiny absolute floor) with RTOL = 1e-4.  The blocks
run in float32 (unit roundoff 6e-8); each output is a handful of chained dot products of length
<= 768 with O(1) terms, whose rounding error grows like sqrt(n)·u ≈ 2e-6 relative per stage, and
a few stages chain (projection → conv → l2norm → recurrence → norm → o_proj).  We observe at
most 1.5e-6 over all blocks; 1e-4 leaves a wide margin for other CPUs / XLA versions while
still catching any real mistake (a wrong sign, scale, transpose or eps gives errors >= 1e-3).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxk3 import collectives, params
from jaxk3.model import abstract_layer
from jaxk3.sharding import COL
from jaxk3.config import KimiK3Config
from jaxk3.kernels.attn_res_norm import attn_res
from jaxk3.layers.embed import embed, lm_head
from jaxk3.layers.kda import kda_step
from jaxk3.layers.mla import mla_step
from jaxk3.layers.moe import mlp, moe
from jaxk3.kernels.rms_norm import gated_rms_norm, rms_norm
from jaxk3.checkpoint import weights_from_hf
from jaxk3.model import random_hf_weights
from refs import np_ref
from conftest import XLA_DEFAULT_OPTIONS  # noqa: E402

RTOL = 1e-4


def shard_map(f, mesh, in_specs, out_specs):
    """shard_map over `mesh` with the replication check off (as the model runs its forward)."""
    return collectives.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def close(got, ref, rtol=RTOL):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = np.max(np.abs(got - ref))
    scale = max(np.max(np.abs(ref)), 1e-30)
    assert err <= rtol * scale + 1e-7, f"max err {err:.3e} vs scale {scale:.3e} (rel {err / scale:.3e})"


def f32(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


@functools.lru_cache(maxsize=None)
def model_weights(mode: str, seed: int = 1, **over):
    cfg = KimiK3Config.tiny_k3(**over) if mode == "k3" else KimiK3Config.tiny_kimi_linear(**over)
    W = random_hf_weights(cfg, seed)
    return cfg, W, weights_from_hf(cfg, W), np_ref.Config(cfg.to_hf_dict())


def mesh(tp):
    return Mesh(np.array(jax.devices()[:tp]), ("tp",))


# ------------------------------------------------------------------------------ norms
def test_rms_norm_and_gated():
    rng = np.random.default_rng(0)
    x, w, z = rng.standard_normal((3, 4, 32)), 1 + 0.1 * rng.standard_normal(32), rng.standard_normal((3, 4, 32))
    close(rms_norm(jnp.float32(x), jnp.float32(w), 1e-5), np_ref.rms_norm(x, w, 1e-5))
    close(gated_rms_norm(jnp.float32(x), jnp.float32(w), jnp.float32(z), 1e-5), np_ref.gated_rms_norm(x, w, z, 1e-5))
    # bf16 input is upcast: same result as the fp32 computation of the rounded input
    xb = jnp.asarray(x, jnp.bfloat16)
    close(rms_norm(xb, jnp.float32(w), 1e-5), np_ref.rms_norm(np.asarray(xb, np.float64), w, 1e-5))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_attn_res(n):
    rng = np.random.default_rng(n)
    srcs = [rng.standard_normal((3, 64)) * (i + 1) for i in range(n)]
    wn, wp = 1 + 0.1 * rng.standard_normal(64), rng.standard_normal((1, 64))
    got = attn_res([jnp.float32(s) for s in srcs], jnp.float32(wn), jnp.float32(wp), 1e-5)
    ref = np.stack([np_ref.attn_res([s[b] for s in srcs], wn, wp, 1e-5) for b in range(3)])
    close(got, ref)


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_attn_res_select_stack_same_bits_on_cpu(monkeypatch, n):
    """attn_res_norm.SELECT_STACK (the stack by selects on the depth index and the mix as a sum; on by default at
    decode's row counts): the same function as the concatenated stack, bitwise on the CPU under jit (bf16 sources of
    different scales, as the step's), against the float64 reference like that form.  More rows than
    SELECT_MAX_ROWS (prefill) keep the concatenate."""
    from jaxk3.kernels import attn_res_norm

    rng = np.random.default_rng(10 + n)
    srcs = [jnp.asarray(rng.standard_normal((2, 256)) * (i + 1), jnp.bfloat16) for i in range(n)]
    wn, wp = jnp.float32(1 + 0.1 * rng.standard_normal(256)), jnp.float32(rng.standard_normal((1, 256)))
    def traced():  # a fresh function each time: jit's cache must not hand back the other form's trace
        # at XLA's default level, whose bits these are: at the suite's LLVM -O0 (conftest.py) the 9 sources' sums add in
        # another order in each form (seen: n = 9 differs in the last bits)
        return jax.jit(lambda *s: attn_res(list(s), wn, wp, 1e-5), compiler_options=XLA_DEFAULT_OPTIONS)

    monkeypatch.setattr(attn_res_norm, "SELECT_STACK", False)
    f = traced()
    assert "select" not in f.lower(*srcs).as_text()
    want = np.asarray(f(*srcs))
    monkeypatch.setattr(attn_res_norm, "SELECT_STACK", True)
    many = [jnp.concatenate([s] * 8) for s in srcs]  # 16 rows: past SELECT_MAX_ROWS, the concatenate's form
    assert attn_res_norm.SELECT_MAX_ROWS < 16 and "select" not in traced().lower(*many).as_text()
    f = traced()
    assert n == 1 or "select" in f.lower(*srcs).as_text()  # the selects' form was traced
    got = np.asarray(f(*srcs))
    np.testing.assert_array_equal(got, want)
    ref = np.stack([np_ref.attn_res([np.asarray(s[b], np.float64) for s in srcs], np.asarray(wn, np.float64),
                                    np.asarray(wp, np.float64), 1e-5) for b in range(2)])
    close(got, ref)
    alone = [np.asarray(s, np.float32) for s in srcs]  # the mix is none of its sources (n > 1): it really mixes
    assert n == 1 or min(np.abs(got - a).max() for a in alone) > 1e-2


# ------------------------------------------------------------------------------- KDA
@pytest.mark.parametrize("mode", ["k3", "kl"])
def test_kda_steps(mode):
    """6 steps, 2 rows; row 1 is a pad row at step 0 (its caches must not move)."""
    cfg, W, host, rcfg = model_weights(mode)
    l = cfg.kda_layers[1]
    w = f32(host.layers[l].attn)
    B, T, C, K = 2, 6, cfg.kda_dim, cfg.short_conv_kernel_size
    rng = np.random.default_rng(2)
    xs = rng.standard_normal((T, B, cfg.hidden_size)).astype(np.float32)
    conv = jnp.zeros((B, 3, C, K - 1), jnp.float32)
    state = jnp.zeros((B, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32)
    step = jax.jit(lambda w, x, c, s, v: kda_step(cfg, w, x, c, s, v, None))
    refs = [np_ref.KDAState(rcfg) for _ in range(B)]
    for t in range(T):
        valid = np.array([True, t > 0])
        out, conv, state = step(w, xs[t], conv, state, valid)
        for b in range(B):
            if valid[b]:
                close(out[b], np_ref.kda_step(rcfg, W, f"model.layers.{l}.self_attn.", xs[t, b], refs[b]))
        if t == 0:
            assert not np.any(np.asarray(state[1])) and not np.any(np.asarray(conv[1]))
    close(state, np.stack([r.S for r in refs]))
    close(conv.reshape(B, 3 * C, K - 1), np.stack([r.conv for r in refs]))


# ------------------------------------------------------------------------------- MLA
@pytest.mark.parametrize("mode", ["k3", "kl"])
def test_mla_steps_absorbed_vs_expanded(mode):
    """Absorbed decode (jaxk3) == non-absorbed expansion of the latent cache (reference)."""
    cfg, W, host, rcfg = model_weights(mode)
    l = cfg.mla_layers[0]
    w = f32(host.layers[l].attn)
    B, T, S = 2, 5, 8
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((T, B, cfg.hidden_size)).astype(np.float32)
    kv = jnp.zeros((B, S, cfg.latent_dim), jnp.float32)
    length = np.zeros(B, np.int32)
    step = jax.jit(lambda w, x, kv, n, v: mla_step(cfg, w, x, kv, n, v, None))
    caches = [[] for _ in range(B)]
    for t in range(T):
        valid = np.array([True, t >= 2])  # row 1 left-padded by 2
        out, kv = step(w, xs[t], kv, length, valid)
        for b in range(B):
            if valid[b]:
                close(out[b], np_ref.mla_step(rcfg, W, f"model.layers.{l}.self_attn.", xs[t, b], caches[b]))
        length = length + valid
    for b in range(B):
        close(kv[b, :length[b]], np.stack(caches[b]))
        assert not np.any(np.asarray(kv[b, length[b]:]))


@pytest.mark.parametrize("tp", [2, 8])
def test_mla_sharded_latent_under_shard_map(tp):
    """The one-gather re-layout of row-sharded q_a ⊕ kv_a gives the replicated result."""
    cfg, W, host, rcfg = model_weights("k3")
    l = cfg.mla_layers[0]
    w = f32(host.layers[l].attn)
    B, S = 2, 4
    x = np.random.default_rng(4).standard_normal((B, cfg.hidden_size)).astype(np.float32)
    kv = jnp.zeros((B, S, cfg.latent_dim), jnp.float32)
    n, valid = jnp.zeros(B, jnp.int32), jnp.ones(B, bool)
    ref_out, ref_kv = mla_step(cfg, w, x, kv, n, valid, None)
    for shard_latent in (True, False):
        specs = params.partition_specs(abstract_layer(cfg, l).attn, shard_latent)
        f = shard_map(lambda w, x, kv: mla_step(cfg, w, x, kv, n, valid, "tp", shard_latent, "lax"), mesh(tp),
                      in_specs=(specs, P(), P()), out_specs=(P(), P()))
        out, kv2 = jax.jit(f)(w, x, kv)
        # not bitwise: a [B, D]x[D, n/tp] GEMM may round differently from the [B, D]x[D, n] one
        close(out, ref_out, 1e-5)
        close(kv2, ref_kv, 1e-5)


# ------------------------------------------------------------------------------- FFN
@pytest.mark.parametrize("mode, rsf, groups", [("k3", 1.0, 1), ("k3", 2.5, 1), ("kl", 2.446, 1), ("k3", 1.0, 4)])
def test_moe(mode, rsf, groups):
    over = dict(num_expert_group=groups, topk_group=2) if groups > 1 else {}
    cfg, W, host, rcfg = model_weights(mode, routed_scaling_factor=rsf, **over)
    l = 2
    assert cfg.layer_ffn[l] == "moe"
    w = f32(host.layers[l].ffn)
    x = np.random.default_rng(5).standard_normal((3, cfg.hidden_size)).astype(np.float32)
    got = jax.jit(lambda w, x: moe(cfg, w, x, None))(w, x)
    ref = np.stack([np_ref.moe(rcfg, W, f"model.layers.{l}.block_sparse_moe.", x[b]) for b in range(3)])
    close(got, ref)


@pytest.mark.parametrize("mode", ["k3", "kl"])
def test_dense_mlp(mode):
    cfg, W, host, rcfg = model_weights(mode)
    w = f32(host.layers[0].ffn)
    x = np.random.default_rng(6).standard_normal((3, cfg.hidden_size)).astype(np.float32)
    got = mlp(cfg, w, jnp.asarray(x), None)
    close(got, np.stack([np_ref.dense_mlp(rcfg, W, "model.layers.0.mlp.", x[b]) for b in range(3)]))


@pytest.mark.parametrize("tp", [1, 4])
def test_moe_and_mlp_under_shard_map(tp):
    """Intermediate-sharded experts / MLP with psum equal the one-device block."""
    cfg, W, host, rcfg = model_weights("k3")
    x = np.random.default_rng(7).standard_normal((3, cfg.hidden_size)).astype(np.float32)
    for l, fn in ((0, mlp), (1, moe)):
        w = f32(host.layers[l].ffn)
        f = shard_map(lambda w, x: fn(cfg, w, x, "tp"), mesh(tp), in_specs=(params.partition_specs(abstract_layer(cfg, l).ffn), P()),
                      out_specs=P())
        close(jax.jit(f)(w, x), fn(cfg, w, jnp.asarray(x), None), 1e-5)


# ------------------------------------------------------------------------ embed / head
@pytest.mark.parametrize("tp", [1, 8])
def test_vocab_parallel_embed_and_head(tp):
    """vocab 1000 padded to 1024 rows, split over tp; the pad rows never leak into the logits."""
    cfg = KimiK3Config.tiny_k3()
    vpad, D = cfg.padded_vocab(tp), cfg.hidden_size
    rng = np.random.default_rng(8)
    table = np.zeros((vpad, D), np.float32)
    table[:cfg.vocab_size] = rng.standard_normal((cfg.vocab_size, D))
    head = table.copy()
    head[cfg.vocab_size:] = 1e3  # would dominate if the padding were not sliced off
    tokens = np.array([0, 999, 511, 512, 127, 128], np.int32)
    h = rng.standard_normal((6, D)).astype(np.float32)

    def local(tok, tab, hd, h):
        return embed(tok, tab, "tp"), lm_head(h, hd, cfg.vocab_size, "tp", "lax")

    f = shard_map(local, mesh(tp), in_specs=(P(), COL, COL, P()), out_specs=(P(), P()))
    x, logits = jax.jit(f)(tokens, table, head, h)
    np.testing.assert_array_equal(np.asarray(x), table[tokens])
    assert logits.shape == (6, cfg.vocab_size)
    close(logits, h.astype(np.float64) @ table[:cfg.vocab_size].T.astype(np.float64))


def test_realistic_tiles_kda_and_mla():
    """docs/SPEC.md §7.1 "realistic-tile" shapes: K3's per-rank TP8 tiles (KDA 12 heads × 128, MLA latent 512+64)."""
    lac = dict(full_attn_layers=[4, 7, 8], kda_layers=[1, 2, 3, 5, 6], num_heads=12, head_dim=128,
               short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True)
    cfg = KimiK3Config.tiny_k3(linear_attn_config=lac, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                               v_head_dim=128, num_attention_heads=4)
    W = random_hf_weights(cfg, 2)
    host, rcfg = weights_from_hf(cfg, W), np_ref.Config(cfg.to_hf_dict())
    xs = np.random.default_rng(10).standard_normal((3, 1, cfg.hidden_size)).astype(np.float32)
    lk, lm = cfg.kda_layers[0], cfg.mla_layers[0]
    wk, wm = f32(host.layers[lk].attn), f32(host.layers[lm].attn)
    conv = jnp.zeros((1, 3, cfg.kda_dim, 3))
    state = jnp.zeros((1, 12, 128, 128))
    kv, n, valid = jnp.zeros((1, 4, cfg.latent_dim)), np.zeros(1, np.int32), np.ones(1, bool)
    st, cache = np_ref.KDAState(rcfg), []
    for t in range(3):
        out, conv, state = kda_step(cfg, wk, xs[t], conv, state, valid, None)
        close(out[0], np_ref.kda_step(rcfg, W, f"model.layers.{lk}.self_attn.", xs[t, 0], st))
        out, kv = mla_step(cfg, wm, xs[t], kv, n + t, valid, None)
        close(out[0], np_ref.mla_step(rcfg, W, f"model.layers.{lm}.self_attn.", xs[t, 0], cache))
    close(state[0], st.S)


# --------------------------------------------------------------------------- prefill forms
def _delta_rule_f64(q, k, v, g, beta, S):
    """T recurrent steps of the gated delta rule in float64 (the definition chunk_delta_rule equals)."""
    q, k, v, g, beta, S = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, S))
    o = np.zeros(v.shape)
    for t in range(q.shape[2]):
        S = np.exp(g[:, :, t])[..., None] * S
        u = beta[:, :, t, None] * (v[:, :, t] - np.einsum("bhk,bhkv->bhv", k[:, :, t], S))
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        o[:, :, t] = np.einsum("bhk,bhkv->bhv", q[:, :, t], S)
    return o, S


@pytest.mark.parametrize("T,chunk,gate", [(64, 32, 0.3), (128, 64, 20.0), (24, 64, 1.0)])
def test_chunk_delta_rule_vs_float64_recurrence(T, chunk, gate):
    """The chunked form against T float64 steps: two and more chunks, gates of -20 per step (e^{-Γ} alone
    would overflow fp32 within five tokens: the form must never take it apart), a prompt shorter than the
    chunk.  Tolerance 2e-5 of max: fp32 sums in another order (measured <= 5e-6)."""
    from jaxk3.kernels.kda_prefill import chunk_delta_rule

    r = np.random.default_rng(T)
    B, H, K, V = 2, 3, 16, 8
    k = r.standard_normal((B, H, T, K))
    args = (r.standard_normal((B, H, T, K)) * 0.3, k / np.linalg.norm(k, axis=-1, keepdims=True),
            r.standard_normal((B, H, T, V)), -np.abs(r.standard_normal((B, H, T, K))) * gate,
            r.uniform(0, 1, (B, H, T)), r.standard_normal((B, H, K, V)))
    o, S = jax.jit(lambda *a: chunk_delta_rule(*a, chunk=chunk))(*(jnp.asarray(a, jnp.float32) for a in args))
    o_ref, S_ref = _delta_rule_f64(*args)
    close(o, o_ref, 2e-5)
    close(S, S_ref, 2e-5)


@pytest.mark.parametrize("mode", ["k3", "kl"])
def test_ring_conv_cache_equals_the_shift_form(mode):
    """The conv cache as a ring of K slots written in place (kda_decode.RING) against the shift form's K-1: a
    ragged prefill in two chunks (left padding), then decode steps with pad steps in between (a row's position
    does not move on them), at every step the same outputs and state bitwise, and the ring's window read back
    at each row's position the shift form's window bitwise (the same values in the same order of sums).
    Both through the layer's jnp path (kernels off on CPU); the kernel's ring form is tested in
    tests/test_kernels.py."""
    from jaxk3.kernels.kda_decode import ring_window
    from jaxk3.layers.kda import kda_prefill

    cfg, W, host, rcfg = model_weights(mode)
    wk = f32(host.layers[cfg.kda_layers[0]].attn)
    B, T, K = 3, 8, cfg.short_conv_kernel_size
    r = np.random.default_rng(5)
    x = jnp.asarray(r.standard_normal((B, 2 * T + 7, cfg.hidden_size)), jnp.float32)
    valid = np.ones((B, 2 * T + 7), bool)
    valid[1, :5], valid[2, :11] = False, False  # left padding in the prefill
    valid[0, 2 * T + 1], valid[2, 2 * T + 2:2 * T + 5] = False, False  # pad steps in decode
    state = jnp.zeros((B, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim))
    shift, ring = jnp.zeros((B, 3, cfg.kda_dim, K - 1)), jnp.zeros((B, 3, cfg.kda_dim, K))
    s1, s2, L = state, state, jnp.zeros(B, jnp.int32)
    pre = jax.jit(lambda c, s, xs, v, p: kda_prefill(cfg, wk, xs, c, s, v, None, chunk=4, pos_B=p))
    step = jax.jit(lambda c, s, xt, v, p: kda_step(cfg, wk, xt, c, s, v, None, pos_B=p))
    for h in (slice(0, T), slice(T, 2 * T)):
        v = jnp.asarray(valid[:, h])
        o1, shift, s1 = pre(shift, s1, x[:, h], v, None)
        o2, ring, s2 = pre(ring, s2, x[:, h], v, L)
        L = L + v.sum(1, dtype=jnp.int32)
        np.testing.assert_array_equal(np.asarray(o2), np.asarray(o1))
        np.testing.assert_array_equal(np.asarray(s2), np.asarray(s1))
        np.testing.assert_array_equal(np.asarray(ring_window(ring, L)), np.asarray(shift))
    for t in range(2 * T, 2 * T + 7):
        v = jnp.asarray(valid[:, t])
        o1, shift, s1 = step(shift, s1, x[:, t], v, None)
        o2, ring, s2 = step(ring, s2, x[:, t], v, L)
        L = L + v
        np.testing.assert_array_equal(np.asarray(o2), np.asarray(o1))
        np.testing.assert_array_equal(np.asarray(s2), np.asarray(s1))
        np.testing.assert_array_equal(np.asarray(ring_window(ring, L)), np.asarray(shift))
    assert np.count_nonzero(np.asarray(shift)) > shift.size // 2  # the windows hold projections, not zeros
    with pytest.raises(ValueError, match="needs the rows' positions"):
        kda_step(cfg, wk, x[:, 0], ring, s2, jnp.asarray(valid[:, 0]), None)
    with pytest.raises(ValueError, match=f"K-1 = {K - 1} .* or K = {K}"):
        kda_step(cfg, wk, x[:, 0], ring[..., :2], s2, jnp.asarray(valid[:, 0]), None, pos_B=L)


@pytest.mark.parametrize("mode", ["k3", "kl"])
def test_prefill_blocks_equal_their_decode_steps(mode, monkeypatch):
    """KDA (chunked form), MLA (causal over prefix + chunk) and MoE (grouped GEMMs) over T tokens per row
    equal T decode steps; ragged rows (left padding), two chunks. Tolerance 1e-5 · max (fp32 reassociation)."""
    from jaxk3.layers.kda import kda_prefill
    from jaxk3.layers.mla import mla_prefill

    cfg, W, host, rcfg = model_weights(mode)
    wk, wm = f32(host.layers[cfg.kda_layers[0]].attn), f32(host.layers[cfg.mla_layers[0]].attn)
    B, T, S = 3, 8, 32
    x = jnp.asarray(np.random.default_rng(11).standard_normal((B, 2 * T, cfg.hidden_size)), jnp.float32)
    valid = np.ones((B, 2 * T), bool)
    valid[1, :5], valid[2, :11] = False, False
    conv, state = jnp.zeros((B, 3, cfg.kda_dim, cfg.short_conv_kernel_size - 1)), jnp.zeros(
        (B, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim))
    kv, length = jnp.zeros((B, S, cfg.latent_dim)), jnp.zeros(B, jnp.int32)
    c, s, k1, L, ok, om = conv, state, kv, length, [], []
    for t in range(2 * T):
        o, c, s = kda_step(cfg, wk, x[:, t], c, s, jnp.asarray(valid[:, t]), None)
        ok.append(o)
        o, k1 = mla_step(cfg, wm, x[:, t], k1, L, jnp.asarray(valid[:, t]), None)
        om.append(o)
        L = L + valid[:, t]
    c2, s2, k2, L2, pk, pm = conv, state, kv, length, [], []
    for h in (slice(0, T), slice(T, 2 * T)):
        o, c2, s2 = kda_prefill(cfg, wk, x[:, h], c2, s2, jnp.asarray(valid[:, h]), None, chunk=4)
        pk.append(o)
        o, k2 = mla_prefill(cfg, wm, x[:, h], k2, L2, jnp.asarray(valid[:, h]), None)
        pm.append(o)
        L2 = L2 + valid[:, h].sum(1)
    for a, b in ((np.concatenate(pk, 1), np.stack(ok, 1)), (np.concatenate(pm, 1), np.stack(om, 1))):
        close(a[valid], b[valid], 1e-5)
    close(s2, s, 1e-5)
    np.testing.assert_array_equal(np.asarray(c2), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(k1))
    wf = f32(host.layers[2].ffn)
    xs = jnp.asarray(np.random.default_rng(12).standard_normal((37, cfg.hidden_size)), jnp.float32)
    close(moe(cfg, wf, xs, None, grouped=True), moe(cfg, wf, xs, None), 1e-5)  # the dense form
    from jaxk3.layers import moe as moe_lib

    w_Nk, ids_Nk = moe_lib.route(cfg, wf.gate, wf.e_score_correction_bias, xs)
    z = xs if wf.routed_expert_down_proj is None else xs @ wf.routed_expert_down_proj.T
    ref = moe_lib.experts_partial(cfg, wf, z, w_Nk, ids_Nk)
    from jaxk3.kernels import moe_grouped as grouped

    for form in (grouped.experts_grouped, grouped.experts_dense):
        close(form(cfg, wf, z, w_Nk, ids_Nk), ref, 1e-5)
    E, I = wf.experts_w1.shape[:2]
    monkeypatch.setattr(grouped, "DENSE_MOE_BYTES", 10 * E * I * 4)  # token blocks of 10 (37 tokens: 4 blocks)
    close(grouped.experts_dense(cfg, wf, z, w_Nk, ids_Nk), ref, 1e-5)
