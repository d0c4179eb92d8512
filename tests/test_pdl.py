"""The early launch of the next kernel (`jaxk3.kernels.registry.PDL_EARLY`: the decode kernels issue
`griddepcontrol.launch_dependents` as each program starts; docs/ARCHITECTURE.md).  It changes when the next kernel's
programs are placed, never what any kernel computes: every kernel XLA launches waits (griddepcontrol.wait) for the one
before it to finish and its writes to be visible before its first memory access.  So the test of it is bitwise:

- on the CPU, interpret mode ignores it (the instruction exists only on the GPU) and gives the same bits;
- its lowering (tests/test_kernels_lowering.py::test_decode_kernels_launch_dependents_early): every decode kernel
  carries the instruction once with it on, none with it off;
- on the GPU, the 48B's decode step (layers 0-3: KDA + MLP, KDA + MoE twice, MLA + MoE; the serving layout, kernels
  auto) with it on gives the logits of the step with it off, bitwise, step after step: a kernel reading what the
  one before it had not yet written would differ."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxk3.kernels import registry


def test_interpret_ignores_early_launch(monkeypatch):
    from jaxk3.kernels import gemv as G

    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((1, 512)), jnp.bfloat16)
    w = jnp.asarray(r.standard_normal((64, 512)) * 0.05, jnp.bfloat16)
    off = np.asarray(G.gemv(x, w, config=G.Config(bn=16, bk=128, splits=2), interpret=True))
    monkeypatch.setattr(registry, "PDL_EARLY", True)
    assert registry.early_launch(interpret=False) and not registry.early_launch(interpret=True)
    on = np.asarray(G.gemv(x, w, config=G.Config(bn=16, bk=128, splits=2), interpret=True))
    np.testing.assert_array_equal(on, off)
    np.testing.assert_allclose(on, np.asarray(G.reference(x, w)), rtol=0, atol=1e-5 * np.abs(off).max())


def _step_logits(monkeypatch, preset: str, layers: str, experts: int | None, B: int, steps: int = 4,
                 context: int = 4096) -> dict:
    """{early: (the step's logits over `steps` greedy steps, the early-launch instructions in its lowered IR)}, the
    same random weights and cache for both: the bench's decode step (serving layout, kernels auto)."""
    from jaxk3.model import StepOptions, build_step
    from jaxk3.tools import bench_decode as bd

    _, first, _, cfg, mesh, (s,) = bd._setup(preset, layers, experts, 1, (B,), bd.with_variants(
        bd.STRATEGIES[:1], [("serving", "auto")]))
    made = bd._Weights(cfg, mesh, "bfloat16")
    weights = made.step_weights(s)
    valid = bd.put_batch(np.ones((B,), bool), mesh)
    out = {}
    for early in (False, True):
        monkeypatch.setattr(registry, "PDL_EARLY", early)  # read as the step is traced: a new step each time
        step = build_step(made.config(s), StepOptions(kernels="auto", serving=made.serving(s), layer_offset=first),
                          mesh)
        cache = bd.random_cache(cfg, mesh, "bfloat16", B, context)
        ids = bd.put_batch(np.arange(B, dtype=np.int32), mesh)
        n = step.lower(weights, cache, ids, valid).as_text().count("griddepcontrol.launch_dependents")
        got = []
        for _ in range(steps):
            logits, ids, cache = step(weights, cache, ids, valid)
            got.append(np.asarray(logits))
        out[early] = got, n
    return out


def test_step_plumbing_on_cpu(monkeypatch):
    """The GPU test's step on the CPU (the tiny config): no kernel lowers the instruction (the CPU runs the jnp
    paths), and the two steps agree bitwise."""
    out = _step_logits(monkeypatch, "tiny", "all", None, 2, steps=2, context=128)
    assert out[False][1] == out[True][1] == 0
    for a, b in zip(out[False][0], out[True][0]):
        assert np.isfinite(a).all() and a.std() > 0
        np.testing.assert_array_equal(b, a)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
def test_step_with_early_launch_on_gpu(monkeypatch, B):
    if jax.default_backend() == "cpu":
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    out = _step_logits(monkeypatch, "kimi-linear-48b", "0-3", 64, B)
    assert out[False][1] == 0 and out[True][1] > 0, (out[False][1], out[True][1])  # the flag reached the kernels
    for a, b in zip(out[False][0], out[True][0]):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(b, a)
