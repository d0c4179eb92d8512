"""The collectives as drop-ins for lax's: every argument lax's take, every transformation
(grad, jvp, vjp, remat, vmap), every place (plain jax.shard_map, eager, pmap, vmap axis
names), results and types (shape, dtype, vma) equal to lax's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.ad_checkpoint import saved_residuals  # what jax's own tests use
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxk3 import collectives as C

pytestmark = pytest.mark.skipif(C.extension() is None, reason=f"jaxk3._ffi not built: {C.extension_error()}")


def mesh_of(order, names=("x",), shape=None):
    devs = np.asarray(jax.devices())[list(order)]
    return jax.sharding.Mesh(devs.reshape(shape or (len(order),)), names)


def data(shape, seed=0, dtype=np.float32):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 2
    return np.where(x == 0, 1.0, x).astype(dtype)


def typeof(x):
    t = jax.typeof(x)
    return t.shape, t.dtype, frozenset(t.mat.varying)


def bits(a):
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


MESH = mesh_of((3, 0, 2, 1))


def model(gather, psum):
    """A small shard_map program mixing the two collectives (a gather feeding a sum)."""

    def body(w, v):
        g = gather(jnp.tanh(v @ w), "x", axis=1, tiled=True)  # [2, 4*3]
        return psum(jnp.sin(g) * g, "x")

    return jax.shard_map(body, mesh=MESH, in_specs=(P(), P("x")), out_specs=P())


def lowered(f, *args) -> str:
    return jax.jit(f).lower(*args).as_text()


@pytest.mark.parametrize("impl", ["auto", "ffi"])
def test_grad_jvp_vjp_remat_match_lax(impl):
    w, v = jnp.asarray(data((5, 3), 1)), jnp.asarray(data((8, 5), 2))
    ours = model(lambda *a, **k: C.all_gather(*a, impl=impl, **k), lambda *a: C.psum(*a, impl=impl))
    ref = model(lax.all_gather, lax.psum)

    def loss(f):
        return lambda w, v: jnp.sum(f(w, v) ** 2)

    text = lowered(jax.grad(loss(ours), argnums=(0, 1)), w, v)
    assert "jaxk3_padded_all_gather" in text and "jaxk3_all_reduce" in text  # 24-byte rows: the padded target
    for transform in (lambda f: jax.grad(loss(f), argnums=(0, 1)),
                      lambda f: jax.grad(jax.checkpoint(loss(f)), argnums=(0, 1)),
                      lambda f: (lambda w, v: jax.jvp(f, (w, v), (jnp.ones_like(w), jnp.ones_like(v)))),
                      lambda f: (lambda w, v: jax.vjp(f, w, v)[1](jnp.ones((2, 12))))):
        got, want = jax.jit(transform(ours))(w, v), jax.jit(transform(ref))(w, v)
        # Not bits: the FFI psum adds the ranks' parts in rank order, lax's in XLA's, and the gradients' float32 sums of
        # terms up to |r| ~ 10 (ulp 9.5e-7) cancel to ~1e-6 in places, so an element may differ by ulps of the largest
        # one (seen: 1.1e-5, ~12 ulps, with the tests' XLA at LLVM -O0, jax 0.12.1) while a wrong transpose or a missing
        # term moves it by the term's size (~1-10).  So 4e-6 of the largest magnitude (~40 ulps), beside rtol 1e-5.
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            r = np.asarray(r)
            np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=4e-6 * max(1.0, float(np.max(np.abs(r)))))
    # remat saves what lax's saves (the collectives are recomputed, not saved)
    assert len(saved_residuals(jax.checkpoint(ours), w, v)) == len(saved_residuals(jax.checkpoint(ref), w, v))


def test_vmap_of_jit_of_shard_map_and_vmap_inside():
    w, vs = jnp.asarray(data((5, 3), 3)), jnp.asarray(data((4, 8, 5), 4))
    ours, ref = model(C.all_gather, C.psum), model(lax.all_gather, lax.psum)
    batched = jax.vmap(jax.jit(ours), in_axes=(None, 0))
    assert "jaxk3_" in jax.jit(batched).lower(w, vs).as_text()  # the batching rule keeps the FFI path
    np.testing.assert_allclose(np.asarray(batched(w, vs)), np.asarray(jax.vmap(jax.jit(ref), in_axes=(None, 0))(w, vs)),
                               rtol=1e-6)

    def inner(gather, psum):  # vmap inside the shard_map body, over a non-collective axis
        return jax.jit(jax.shard_map(lambda v: jax.vmap(lambda u: psum(gather(u, "x", axis=0), "x"))(v),
                                     mesh=MESH, in_specs=P(None, "x"), out_specs=P()))

    x = jnp.asarray(data((3, 8, 2), 5))
    np.testing.assert_allclose(np.asarray(inner(C.all_gather, C.psum)(x)), np.asarray(inner(lax.all_gather, lax.psum)(x)),
                               rtol=1e-6)


def test_vmap_and_pmap_axis_names_fall_back():
    """An axis bound by vmap(..., axis_name=) is lax's to serve; under pmap (a shard_map in this
    jax) the FFI path applies.  Both equal lax's, neither raises."""
    x = jnp.asarray(data((4, 3), 6))
    for ours, theirs in ((lambda v: C.all_gather(v, "i"), lambda v: lax.all_gather(v, "i")),
                         (lambda v: C.psum(v, "i"), lambda v: lax.psum(v, "i"))):
        np.testing.assert_array_equal(np.asarray(jax.vmap(ours, axis_name="i")(x)),
                                      np.asarray(jax.vmap(theirs, axis_name="i")(x)))
        xs = x[:4]
        np.testing.assert_array_equal(np.asarray(jax.pmap(ours, axis_name="i", devices=jax.devices()[:4])(xs)),
                                      np.asarray(jax.pmap(theirs, axis_name="i", devices=jax.devices()[:4])(xs)))
    with pytest.raises(NameError):
        jax.jit(lambda v: C.psum(v, "nowhere"))(x)


def test_every_argument_of_lax():
    """axis_index_groups (None included), to=, the empty axis tuple, size-one groups: the same
    results and types as lax."""
    mesh = mesh_of(range(8), names=("a", "b"), shape=(1, 8))
    x = jax.device_put(data((8, 6), 7), NamedSharding(mesh, P("b")))
    results = {}

    def body(v, gather, psum):
        outs = [gather(v, "b", axis_index_groups=None), gather(v, "b", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]),
                gather(v, "b", to="invarying"), gather(v, (), axis=0), gather(v, "a"), gather(v, ("a", "b"), tiled=True),
                psum(v, ()), psum(v, "a"), psum(v, "b", axis_index_groups=None), psum(v, ("b",))]
        results[gather] = [typeof(o) for o in outs]
        return [lax.pcast(o, tuple(n for n in ("a", "b") if n not in typeof(o)[2]), to="varying") for o in outs]

    def run(gather, psum):
        return jax.jit(jax.shard_map(lambda v: body(v, gather, psum), mesh=mesh, in_specs=(P("b"),),
                                     out_specs=P(("a", "b"))))(x)

    got, want = run(C.all_gather, C.psum), run(lax.all_gather, lax.psum)
    assert results[C.all_gather] == results[lax.all_gather]
    for g, r in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(r))


@pytest.mark.parametrize("axis,tiled", [(0, False), (1, False), (-1, False), (0, True), (-1, True)])
@pytest.mark.parametrize("in_spec", [P("x"), P()])
def test_gather_types_equal_laxs(axis, tiled, in_spec):
    x = jax.device_put(data((8, 6), 8), NamedSharding(MESH, in_spec))
    types = {}

    def run(gather):
        def body(v):
            g = gather(v, "x", axis=axis, tiled=tiled)
            types[gather] = typeof(g)
            return g

        return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(in_spec,), out_specs=P("x")))(x)

    np.testing.assert_array_equal(bits(run(C.all_gather)), bits(run(lax.all_gather)))
    assert types[C.all_gather] == types[lax.all_gather]


def test_shard_map_wrapper_has_jax_shard_maps_signature():
    x = jax.device_put(data((4, 8), 9), NamedSharding(MESH, P("x")))

    @C.shard_map(mesh=MESH, in_specs=P("x"), out_specs=P())
    def decorated(v):
        return C.psum(v, "x")

    want = np.asarray(x).reshape(4, 1, 8).sum(0)
    np.testing.assert_allclose(np.asarray(jax.jit(decorated)(x)), want, rtol=1e-6)
    with jax.set_mesh(MESH):  # mesh from context
        f = C.shard_map(lambda v: C.psum(v, "x"), in_specs=P("x"), out_specs=P())
        np.testing.assert_allclose(np.asarray(jax.jit(f)(x)), want, rtol=1e-6)
        seen = []

        def body(v):
            seen.append(C.explain(v, "x", op="psum"))
            return C.psum(v, "x")

        jax.jit(C.shard_map(body, in_specs=P("x"), out_specs=P()))(x)
        assert seen[0].path == "ffi" and seen[0].groups  # the concrete devices, from the context


def test_eager_shard_map():
    x = jnp.asarray(data((4, 3), 10))
    f = jax.shard_map(lambda v: (C.all_gather(v, "x", tiled=True), C.psum(v, "x")), mesh=MESH, in_specs=P("x"),
                      out_specs=(P("x"), P()))
    g = jax.shard_map(lambda v: (lax.all_gather(v, "x", tiled=True), lax.psum(v, "x")), mesh=MESH, in_specs=P("x"),
                      out_specs=(P("x"), P()))
    for a, b in zip(f(x), g(x)):
        np.testing.assert_array_equal(bits(a), bits(b))
