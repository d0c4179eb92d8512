"""Every device kernel compiled (Triton) and run at the real per-rank shapes of the two presets:
K3 at TP 1, 2 and 8 (heads, the MoE intermediate and the KDA channels split over TP) and
Kimi-Linear-48B at TP 1.  Compiled kernel against its jnp reference on random inputs; before each
compiled call the allocator's free memory is filled with NaN (`_poison`), so an output element the
kernel fails to write shows up as NaN.  The case builders (`CASES`, `case`) are shared with
scripts/gpu/kernels_real.py, which times the same cases against the XLA path.

Tolerances, per kernel (max |kernel - ref| / max |ref|):
  rms_norm                 1e-4: the same fp32 expression, D-long sums in another order (~1e-7
                           relative), through an rsqrt;
  kda_decode               1e-4: fp32 arithmetic, 128-term state contractions in another order;
  router_topk              ids equal, weights 1e-5 relative: the same fp32 terms (sigmoid ulps);
                           run at every preset (only_where_faster=False), not only where auto takes it;
  mla_decode               1e-2 against the reference at full fp32 precision (its dots would be TF32
                           under JAX's default precision on Hopper): the kernel's dots take q and p
                           rounded to bf16 (u = 2^-8), which moves the output by up to ~u of its size
                           (measured 0.4-1.3 u in emulation at these shapes); the derivation and the
                           bugs it still catches are at MLA_TOL in tests/test_kernels.py;
  moe_experts              4e-3: bf16 experts, the [B, I] intermediate rounded to bf16 on both paths
                           but from fp32 sums taken in another order, so single elements may round
                           one bf16 ulp (2^-8) apart before the 1536-3072-term down projection
                           (Kimi-Linear: w1 | w3 joined, and the shared experts fused when bf16);
  moe_grouped              4e-3: the same argument for a prefill chunk's [N, I] intermediate.

The prefill kernels (`PREFILL_CASES`, `prefill_case`; B = 1: a 512-token chunk on an empty cache, B = 8: 128 tokens
a row after ragged prefixes), against their references at full fp32 precision:
  kda_prefill              1e-4: fp32 (TF32x3 dots) over 8 chunks of carried state, as tests/test_kernels.py's
                           compiled test at the 48B's dims (a single TF32 product would show as ~1e-3);
  mla_prefill, both forms  1e-2 (MLA_TOL): the absorbed form rounds its query, the per-head form its expanded
                           keys and values, to bf16 once; the same size of error as mla_decode's (u = 2^-8).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxk3 import kernels

# (preset, tp): the per-rank shapes
PRESETS = [("k3", 1), ("k3", 2), ("k3", 8), ("kimi-linear-48b", 1)]
CTX = 4096  # MLA cache slots


def _cfg(preset: str):
    from jaxk3.tools.bench_decode import load_config

    return load_config(preset)


def _poison(mb: int = 512):
    """Fill free device memory with NaN: the next allocations (a compiled call's outputs) reuse it."""
    x = jnp.full((mb << 18,), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x


def case(kernel: str, preset: str, tp: int, B: int, seed: int = 0, fmt: str = "dense"):
    """(args, kwargs) of one call of `kernel` at the preset's per-rank shapes, or a str saying why
    the kernel has no such call at this preset (e.g. no AttnRes in Kimi-Linear)."""
    cfg = _cfg(preset)
    r = np.random.default_rng(seed + 7 * B + tp)  # small host-side draws (ids, gates)
    keys = iter(jax.random.split(jax.random.key(seed + 7 * B + tp), 64))  # the arrays: drawn on the device

    def a(*shape, s=1.0, dt=jnp.float32):
        return (jax.random.normal(next(keys), shape, jnp.float32) * s).astype(dt)
    if kernel == "rms_norm":  # the MLA kv_a norm (512); hidden norms do not fit the kernel (power of two)
        return (a(B, cfg.kv_lora_rank, dt=jnp.bfloat16), 1 + a(cfg.kv_lora_rank, s=0.1, dt=jnp.bfloat16),
                cfg.rms_norm_eps), {}
    if kernel == "kda_decode":
        from jaxk3.kernels import kda_decode as kda

        H, Kd, K = cfg.kda_num_heads // tp, cfg.kda_head_dim, cfg.short_conv_kernel_size
        C = H * Kd
        cw = kda.CoreWeights(conv_3CK=a(3, C, K, s=0.3), dt_bias_C=a(C),
                             A_log_H=jnp.log(jnp.asarray(r.uniform(1, 16, H), jnp.float32)), o_norm_K=1 + a(Kd, s=0.1))
        valid = jnp.asarray([True] * max(B - 1, 1) + [False] * (B > 1), bool)
        return (cfg, a(B, 3, C, dt=jnp.bfloat16), a(B, 3, C, K - 1, dt=jnp.bfloat16), cw, a(B, C),
                jax.nn.sigmoid(a(B, H)), a(B, C), a(B, H, Kd, Kd, s=0.1), valid), {}
    if kernel == "router_topk":  # at every preset, also where auto keeps XLA (Kimi-Linear)
        E = cfg.num_experts
        return (cfg, a(B, E), a(E, s=0.01)), {"only_where_faster": False}
    if kernel == "mla_decode":
        H, R, P = cfg.num_attention_heads // tp, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        length = jnp.asarray(([CTX - 1, 777, 2048, 5, 4000, 1, 3000, 1234] * 2)[:B], jnp.int32)
        return (a(B, H, R), a(B, H, P), a(B, CTX, R + P, dt=jnp.bfloat16), length, 0.07), {}
    if kernel == "moe_experts":
        from jaxk3.layers import moe

        E = 2 * cfg.num_experts_per_token  # memory: only the selected experts are read
        I, L, k = cfg.moe_intermediate_size // tp, cfg.moe_hidden, cfg.num_experts_per_token
        kcfg = dataclasses.replace(cfg, num_experts=E)
        if fmt == "dense":
            ex = [a(E, I, L, s=0.02, dt=jnp.bfloat16), a(E, L, I, s=0.02, dt=jnp.bfloat16), a(E, I, L, s=0.02, dt=jnp.bfloat16)]
        else:
            def packed(O, In):
                return moe.MXFP4(jax.random.randint(next(keys), (E, O, In // 2), 0, 256, jnp.int32).astype(jnp.uint8),
                                 jax.random.randint(next(keys), (E, O, In // 32), 119, 122, jnp.int32).astype(jnp.uint8))
            ex = [packed(I, L), packed(L, I), packed(I, L)]
            ex = moe.with_f16(ex, moe.f16_exact(ex))  # as the loader marks them
        w = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=ex[0], experts_w2=ex[1], experts_w3=ex[2])
        ids = jnp.asarray(np.stack([r.permutation(E)[:k] for _ in range(B)]), jnp.int32)
        wk = jnp.asarray(r.uniform(0.05, 0.3, (B, k)), jnp.float32)
        shared = None
        if cfg.routed_expert_hidden_size is None:  # Kimi-Linear: the serving layout's w1 | w3 (+ shared, bf16)
            from jaxk3.kernels.moe_experts import SharedMLP

            from jaxk3 import params

            if fmt == "dense":
                shared = SharedMLP(a(2 * I, L, s=0.02, dt=jnp.bfloat16), a(L, I, s=0.02, dt=jnp.bfloat16))
            w = params.serve_local(w)
        # every preset shape, also where auto keeps XLA (only_where_faster=False)
        return (kcfg, w, a(B, L, dt=jnp.bfloat16), wk, ids, shared), {"only_where_faster": False}
    if kernel == "moe_grouped":  # a prefill chunk of PREFILL_TOKENS * B tokens over GROUPED_EXPERTS experts
        from jaxk3.layers import moe

        E = min(cfg.num_experts, GROUPED_EXPERTS)
        I, L, k, N = cfg.moe_intermediate_size // tp, cfg.moe_hidden, cfg.num_experts_per_token, PREFILL_TOKENS * B
        kcfg = dataclasses.replace(cfg, num_experts=E)
        w = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=None, experts_w3=None,
                           experts_w2=a(E, L, I, s=0.02, dt=jnp.bfloat16), experts_w13=a(E, 2 * I, L, s=0.02, dt=jnp.bfloat16))
        ids = jnp.asarray(np.stack([r.permutation(E)[:k] for _ in range(N)]), jnp.int32)
        wk = jnp.asarray(r.uniform(0.05, 0.3, (N, k)), jnp.float32)
        return (kcfg, w, a(N, L, dt=jnp.bfloat16), wk, ids), {}
    raise KeyError(kernel)


PREFILL_TOKENS = 64  # moe_grouped: 64 and 512 tokens (B = 1, 8): few and many rows per expert
GROUPED_EXPERTS = 64  # moe_grouped: the local experts kept (memory: K3's 896 at TP 1 would be 59 GB)
KERNELS = ["rms_norm", "kda_decode", "router_topk", "mla_decode", "moe_experts", "moe_experts_mxfp4", "moe_grouped"]
TOL = dict(rms_norm=1e-4, kda_decode=1e-4, router_topk=1e-5, mla_decode=1e-2, moe_experts=4e-3, moe_grouped=4e-3)
# kernels whose shapes do not depend on TP run at one TP per preset
TP_FREE = {"rms_norm", "router_topk"}
CASES = [(k, p, tp) for k in KERNELS for p, tp in PRESETS if not (k in TP_FREE and tp > 1)]


PREFILL_KERNELS = ["kda_prefill", "mla_prefill", "mla_prefill_heads"]  # the last: the per-head form (Config HEADS)
PREFILL_CASES = [(k, p, tp) for k in PREFILL_KERNELS for p, tp in PRESETS]
TOL.update(kda_prefill=1e-4, mla_prefill=1e-2)
PREFIXES = [700, 0, 3000, 5, 1024, 64, 2047, 300]  # B = 8: slots already cached per row


def prefill_case(kernel: str, preset: str, tp: int, B: int, seed: int = 0, abstract: bool = False):
    """(args, kwargs) of one prefill kernel call at the preset's per-rank shapes (`abstract`: ShapeDtypeStructs,
    nothing allocated).  kda_prefill: q scaled as the layer scales it, unit-norm k, gates -0.3|N(0,1)|, a random
    state; mla_prefill: unit-normal queries and bf16 cache, W_kvb scaled for O(1) scores, each token's limit its own
    slot (prefix + t); kwargs name the form (`mla_prefill_heads`: the per-head form)."""
    cfg = _cfg(preset)
    T = 512 if B == 1 else 128
    keys = iter(jax.random.split(jax.random.key(seed + 7 * B + tp), 16))

    def a(*shape, s=1.0, dt=jnp.float32):
        if abstract:
            return jax.ShapeDtypeStruct(shape, dt)
        return (jax.random.normal(next(keys), shape, jnp.float32) * s).astype(dt)
    if kernel == "kda_prefill":
        H, K = cfg.kda_num_heads // tp, cfg.kda_head_dim
        q, k, v = a(B, H, T, K, s=K ** -0.5), a(B, H, T, K), a(B, H, T, K)
        g, beta, state = a(B, H, T, K), a(B, H, T), a(B, H, K, K)
        if not abstract:
            k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
            g, beta = -0.3 * jnp.abs(g), jax.nn.sigmoid(beta)
        return (q, k, v, g, beta, state), {"chunk": 64}
    from jaxk3.kernels import mla_prefill as M

    H, N, V = cfg.num_attention_heads // tp, cfg.qk_nope_head_dim, cfg.v_head_dim
    R, P = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    prefix = jnp.asarray(PREFIXES[:B] if B > 1 else [0], jnp.int32)
    limit = prefix[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    args = (a(B, T, H, N), a(B, T, H, P), a(B, CTX, R + P, dt=jnp.bfloat16),
            jax.ShapeDtypeStruct(limit.shape, jnp.int32) if abstract else limit, a(H, N + V, R, s=R ** -0.5), 0.07)
    return args, {"config": M.HEADS if kernel == "mla_prefill_heads" else M.Config()}


def prefill_name(kernel: str) -> str:
    """The registered kernel of a prefill case (`mla_prefill_heads` is mla_prefill in its per-head form)."""
    return "mla_prefill" if kernel.startswith("mla_prefill") else kernel


def run_prefill_case(kernel: str, preset: str, tp: int, B: int):
    """(why-not or None, relative error) of a compiled prefill kernel against its reference at full fp32 precision;
    mla_prefill over a cache whose slots past each row's last token are NaN (never to be read)."""
    name = prefill_name(kernel)
    args, kw = prefill_case(kernel, preset, tp, B)
    why = kernels.REGISTRY[name].fits(*args, **kw)
    if why:
        return why, None
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda *x: kernels.REGISTRY[name].reference(*x, **kw), static_argnums=(
            (5,) if name == "mla_prefill" else ()))(*args)
    run_args = args
    if name == "mla_prefill":
        qn, qpe, kv, limit, wkvb, scale = args
        pos = jnp.arange(kv.shape[1])[None, :, None]
        run_args = (qn, qpe, jnp.where(pos > limit[:, -1, None, None], jnp.nan, kv).astype(kv.dtype), limit, wkvb, scale)
    f, dyn = bind(lambda *x: kernels.call(name, *x, mode="on", **kw), run_args)
    _poison()
    got = f(*dyn)
    return None, compare(name, got, ref)


def split(kernel: str) -> tuple[str, str]:
    return ("moe_experts", "mxfp4") if kernel == "moe_experts_mxfp4" else (kernel, "dense")


def compare(kernel: str, got, ref) -> float:
    """Max relative error (max |got - ref| / max |ref|) over the outputs; raises on a mismatch of ids."""
    if kernel == "router_topk":
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))
        return float(np.max(np.abs(np.asarray(got[0]) - np.asarray(ref[0])) / np.abs(np.asarray(ref[0]))))
    gs = got if isinstance(got, tuple) else (got,)
    rs = ref if isinstance(ref, tuple) else (ref,)
    err = 0.0
    for g, r_ in zip(gs, rs):
        g = np.asarray(jnp.asarray(g, jnp.float32))
        r_ = np.asarray(jnp.asarray(r_, jnp.float32))
        assert g.shape == r_.shape
        assert np.isfinite(g).all(), "non-finite output (an element not written, or a poisoned slot read)"
        err = max(err, float(np.max(np.abs(g - r_)) / max(float(np.max(np.abs(r_))), 1e-30)))
    return err


def bind(fn, args):
    """(jit of fn over the array arguments, those arguments): configs, floats and None are closed over
    (static), so that eps / scale stay Python constants as in the step."""
    dyn = [i for i, x in enumerate(args) if isinstance(x, (jax.Array, list, tuple)) or hasattr(x, "experts_w1")
           or hasattr(x, "conv_3CK") or hasattr(x, "gate_up")]

    def f(*d):
        full = list(args)
        for i, x in zip(dyn, d):
            full[i] = x
        return fn(*full)
    return jax.jit(f), [args[i] for i in dyn]


def reference(name: str, args, kw=None):
    """The kernel's jnp reference on `args`; mla_decode's at full fp32 dot precision (not TF32)."""
    if name == "mla_decode":
        with jax.default_matmul_precision("highest"):
            return kernels.REGISTRY[name].reference(*args, **(kw or {}))
    return kernels.REGISTRY[name].reference(*args, **(kw or {}))


def run_case(kernel: str, preset: str, tp: int, B: int):
    """(why-not or None, relative error) of the compiled kernel against the reference at one case."""
    name, fmt = split(kernel)
    args, kw = case(name, preset, tp, B, fmt=fmt)
    why = kernels.REGISTRY[name].fits(*args, **kw)
    if why:
        return why, None
    ref = reference(name, args, kw)
    run_args = args
    if name == "mla_decode":  # slots past each row's length hold NaN: the kernel must never read them
        ql, qpe, kv, length, scale = args
        pos = jnp.arange(kv.shape[1])[None, :, None]
        run_args = (ql, qpe, jnp.where(pos > length[:, None, None], jnp.nan, kv).astype(kv.dtype), length, scale)
    f, dyn = bind(lambda *a: kernels.call(name, *a, mode="on", **kw), run_args)
    _poison()
    got = f(*dyn)
    return None, compare(name, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("kernel,preset,tp", CASES + PREFILL_CASES)
def test_kernel_real_dims_on_gpu(kernel, preset, tp, B):
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    prefill = kernel in PREFILL_KERNELS
    why, err = (run_prefill_case if prefill else run_case)(kernel, preset, tp, B)
    if why:
        pytest.skip(f"does not fit at {preset} TP {tp}: {why}")
    name = prefill_name(kernel) if prefill else split(kernel)[0]
    assert err <= TOL[name], f"{kernel} {preset} TP {tp} B {B}: rel err {err:.2e}"


def test_prefill_cases_fit_on_cpu():
    """Every prefill case fits its kernel at every preset shape (shapes only), so that the GPU test above runs them all
    rather than skipping one; the per-head form's widths are the same at K3 and Kimi-Linear (n 128, v 128, P 64)."""
    for kernel, preset, tp in PREFILL_CASES:
        name = prefill_name(kernel)
        for B in (1, 8):
            args, kw = prefill_case(kernel, preset, tp, B, abstract=True)
            assert kernels.REGISTRY[name].fits(*args, **kw) is None, (kernel, preset, tp, B)


@pytest.mark.parametrize("kernel", PREFILL_KERNELS)
@pytest.mark.parametrize("tp,B", [(1, 8), (8, 1)])
def test_prefill_kernels_lower_at_k3(kernel, tp, B):
    """The prefill kernels at K3's per-rank shapes (96 or 12 heads) lowered to Triton IR for an sm_90 on the CPU
    (jaxk3.tools.triton_lowering): what the first GPU call would refuse at lowering shows up here."""
    from jaxk3.tools.triton_lowering import lower

    name = prefill_name(kernel)
    args, kw = prefill_case(kernel, "k3", tp, B, abstract=True)
    if name == "mla_prefill":
        n = lower(lambda *x: kernels.REGISTRY[name].device(*x, 0.07, **kw), *args[:5])
    else:
        n = lower(lambda *x: kernels.REGISTRY[name].device(*x, **kw), *args)
    assert n >= 1


def test_real_cases_build_and_fit_on_cpu():
    """mla_decode fits at every preset shape after its tiling (shapes only: nothing this large is
    built on the CPU): bf16 tiles of 16 heads x 32 slots (89,344 B of shared memory), and >= MIN_PROGRAMS
    (256, ~2 per SM) wherever a part of two blocks allows it; a tiling too large for shared
    memory is named, not crashed on.  The router gate: auto takes the kernel at K3, not Kimi-Linear."""
    from jaxk3.kernels import mla_decode as M
    from jaxk3.kernels import router

    s = jax.ShapeDtypeStruct
    for preset, tp in PRESETS:
        cfg = _cfg(preset)
        H, R, P = cfg.num_attention_heads // tp, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        for B in (1, 8):
            why = M.fits(s((B, H, R), jnp.float32), s((B, H, P), jnp.float32), s((B, CTX, R + P), jnp.bfloat16),
                         s((B,), jnp.int32), 0.07)
            assert why is None, why
            Hb, bs, split = M.tiles(B, H, CTX, R, P)
            assert (Hb, bs) == (16, 32) and M.smem_estimate(Hb, bs, R, P) == 89_344
            programs = B * -(-H // Hb) * (CTX // split)
            assert programs >= M.MIN_PROGRAMS or split == 2 * bs, (preset, tp, B, programs, split)
            E = cfg.num_experts
            why = router.fits(cfg, s((B, E), jnp.float32), s((E,), jnp.float32))
            assert (why is None) == (preset == "k3"), why
    why = M.fits(s((1, 96, 512), jnp.float32), s((1, 96, 64), jnp.float32), s((1, CTX, 576), jnp.bfloat16),
                 s((1,), jnp.int32), 0.07, block_h=128, block_s=64, num_warps=16)
    assert "shared memory" in why and "303,360" in why
