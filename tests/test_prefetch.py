"""The L2 prefetch riding on a latency-bound kernel (jaxk3.kernels.prefetch): the extra programs read every element of
the weight once (their sums are the weight's, slot by slot), and the kernels that carry them give the same results as
without them (interpret mode here; compiled on a GPU in the `gpu`-marked tests).

"The same" is to float32 rounding, SAME = 1e-6 of the output's largest magnitude, not bit for bit: the kernel's body
now sits in a branch, and a compiler may contract or order its float arithmetic there otherwise (XLA on the CPU, in
interpret mode, does: up to 8e-8 measured).  A wrong program mapping moves outputs by their own size."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxk3.kernels import prefetch as pf

SAME = 1e-6


def _same(a, b):
    a, b = (np.asarray(x.astype(jnp.float32)) for x in (a, b))
    np.testing.assert_allclose(b, a, rtol=0, atol=SAME * np.abs(a).max())


def _w(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.bfloat16)


def test_plan_covers_the_weight_in_whole_steps():
    """A plan's slots tile the weight's [rows, ROW] view exactly, in whole loop steps, in groups of the kernel's
    grid rows; no plan where nothing divides (the kernel then runs without extra programs)."""
    s = jax.ShapeDtypeStruct
    p = pf.plan(s((2304, 4096), jnp.bfloat16), 32, 128)  # the 48B's o_proj under kda_decode_in's 32 heads
    assert p is not None and p.slots % 32 == 0 and p.slots >= 128
    assert p.slots * p.rows * pf.ROW == 2304 * 4096 and p.rows % (pf.TILE * pf.UNROLL) == 0
    assert pf.extend((1, 32, 4), p) == (1, 32, 4 + p.slots // 32)
    assert pf.plan(s((256, 256), jnp.bfloat16), 8, 8) is None  # 128 rows: no 8·x slots of whole steps
    assert pf.plan(s((2304, 4096), jnp.bfloat16), 32, 0) is None
    assert pf.plan(s((3, 5), jnp.bfloat16), 1, 1) is None  # not whole rows of the view


def _toy(x_ref, y_ref, ids=None):
    from jax.experimental import pallas as pl

    b, m, j = ids or (pl.program_id(0), pl.program_id(1), pl.program_id(2))
    y_ref[b, m, j] = x_ref[b, m, j] * 2.0 + m


@pytest.mark.parametrize("grid,shape,wanted", [((2, 3, 4), (96, 1024), 5), ((1, 4, 2), (64, 2048), 4)])
def test_wrap_keeps_the_kernel_and_reads_every_row(grid, shape, wanted):
    """A toy kernel wrapped (interpret mode): its output is as without the wrapper, and the extra programs' sums are
    each slot's share of the weight: a wrong slot mapping, a skipped tile or a row b > 0 writing would change one."""
    from jax.experimental import pallas as pl

    x = jnp.asarray(np.random.default_rng(1).standard_normal(grid), jnp.float32)
    w = _w(shape)
    p = pf.plan(w, grid[1], wanted)
    assert p is not None
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    y, s = pl.pallas_call(pf.wrap(_toy, 1, grid, p), grid=pf.extend(grid, p), in_specs=[any_] * 2,
                          out_specs=[any_] * 2, out_shape=(jax.ShapeDtypeStruct(grid, jnp.float32), pf.out_shape(p)),
                          interpret=True)(x, pf.view(w, p))
    plain = pl.pallas_call(_toy, grid=grid, in_specs=[any_], out_specs=any_,
                           out_shape=jax.ShapeDtypeStruct(grid, jnp.float32), interpret=True)(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain))
    ref = np.asarray(pf.reference(w, p))
    np.testing.assert_allclose(np.asarray(s), ref, rtol=1e-5, atol=1e-3)
    assert np.abs(ref[1:] - ref[:-1]).min() > 1e-2  # the slots' sums differ, so a wrong slot would be seen


def _kda_in(B, prefetch_slots, monkeypatch):
    from test_kernels import _kda_in_case

    from jaxk3.kernels import kda_decode as KD

    cfg, args = _kda_in_case(jnp.bfloat16, B)
    w = _w((cfg.hidden_size, 4 * cfg.kda_dim), seed=3)  # any weight: only read
    monkeypatch.setattr(KD, "PREFETCH", 0)
    plain = KD.kda_decode_in(cfg, *args, interpret=True, gated=False)
    monkeypatch.setattr(KD, "PREFETCH", prefetch_slots)
    assert pf.plan(w, cfg.kda_num_heads, prefetch_slots) is not None
    got = KD.kda_decode_in(cfg, *args, interpret=True, gated=False, prefetch=w)
    return plain, got


@pytest.mark.parametrize("B", [1, 3])
def test_kda_decode_in_with_prefetch_is_the_same(B, monkeypatch):
    """kda_decode_in with the o_proj-sized weight prefetched by extra programs (interpret mode): every output as
    without, to SAME (the extra programs write only their own output)."""
    plain, got = _kda_in(B, 16, monkeypatch)
    for a, b in zip(plain, got):
        _same(a, b)


def test_mla_decode_uv_with_prefetch_is_the_same(monkeypatch):
    """mla_decode_uv with a weight prefetched by extra programs of its merge kernel (interpret mode): the output as
    without, to SAME."""
    from test_kernels import _mla_case

    from jaxk3.kernels import mla_decode as M

    ql, qpe, kv, poisoned, length = _mla_case(2, 16, 128, 64, 16, [100, 7])
    wkvb = jnp.asarray(np.random.default_rng(5).standard_normal((16, 48, 64)) * 0.125, jnp.bfloat16)
    w = _w((1024, 512), seed=4)
    f = functools.partial(M.mla_decode_uv, ql, qpe, poisoned, length, 0.07, wkvb, 16, interpret=True, split=64)
    monkeypatch.setattr(M, "PREFETCH", 0)
    plain = f()
    monkeypatch.setattr(M, "PREFETCH", 16)
    assert pf.plan(w, 16, 16) is not None
    _same(plain, f(prefetch=w))


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
def test_prefetch_kernels_on_gpu(B, monkeypatch):
    """Compiled at Kimi-Linear-48B's dims with o_proj's weight [2304, 4096] prefetched (kda_decode_in under its 32
    heads; the MLA merge under its 32 heads at a 4K cache): the outputs as the same kernels' without it, to SAME
    (and how many differ at all is printed)."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    from test_kernels import _kda_in_case, _mla_case

    from jaxk3.kernels import kda_decode as KD
    from jaxk3.kernels import mla_decode as M

    w = _w((2304, 4096), seed=6)
    cfg, args = _kda_in_case(jnp.bfloat16, B, real=True)
    ql, qpe, kv, poisoned, length = _mla_case(B, 32, 4096, 512, 64, [4095, 777, 2048, 5, 4000, 1, 3000, 1234][:B])
    wkvb = jnp.asarray(np.random.default_rng(5).standard_normal((32, 256, 512)) * 512 ** -0.5, jnp.bfloat16)
    outs = {}
    for n in (0, 128):
        monkeypatch.setattr(KD, "PREFETCH", n)
        monkeypatch.setattr(M, "PREFETCH", n)
        kda = jax.jit(lambda *a: KD.kda_decode_in(cfg, *a[:-1], gated=False, prefetch=a[-1]))(*args, w)
        mla = jax.jit(lambda *a: M.mla_decode_uv(*a[:4], 0.07, a[4], 128, prefetch=a[5]))(
            ql, qpe, poisoned, length, wkvb, w)
        outs[n] = [np.asarray(o.astype(jnp.float32)) for o in (*kda, mla)]
    assert np.isfinite(outs[0][-1]).all()
    print("elements that differ:", [int((a != b).sum()) for a, b in zip(outs[0], outs[128])])
    for a, b in zip(outs[0], outs[128]):
        _same(a, b)
