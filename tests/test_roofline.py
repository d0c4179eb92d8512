"""JAX's roofline cost model (jax.experimental.roofline) counts jaxk3's collectives as lax's: the
same flops, HBM bytes, ICI bytes and ICI latency for a shard_map'ed function written with
collectives.all_gather / collectives.psum as for the same function with lax's, forward and with
its gradient (jaxk3/collectives/roofline.py)."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.extend.core import jaxprs_in_params
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxk3 import _compat
from jaxk3 import collectives as C
from jaxk3.collectives import roofline as rules

pytestmark = pytest.mark.skipif(rules.registered() is not None, reason=str(rules.registered()))

if rules.registered() is None:
    from jax.experimental import roofline


def mesh_of(shape, names):
    return jax.make_mesh(shape, names)


def inputs(mesh, specs, dtype=jnp.float32, shape=(8, 8)):
    return tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, s)) for s in specs)


def primitives(f, *args) -> set:
    """The primitives of f's jaxpr, shard_map bodies included."""
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.add(eqn.primitive.name)
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


def both(make):
    """make(gather, psum) -> f, for lax's collectives and for ours."""
    return make(lax.all_gather, lax.psum), make(C.all_gather, C.psum)


def assert_same(ref, ours, *, collective_axes):
    assert ours == ref
    for axis in collective_axes:  # and the collectives were counted at all
        assert ref.ici_bytes.get(axis, 0) > 0 and ref.ici_latency.get(axis, 0) > 0, ref


def gather_matmul(gather, psum):
    def f(a, b):  # a: [8, 8/2] over x; b: [8, 8/4] over (y, z)
        a = gather(a, "x", axis=1, tiled=True)
        b = gather(b, ("y", "z"), axis=1, tiled=True)
        c = a @ b
        return psum(c * jax.lax.axis_index("z").astype(c.dtype), ("x", "y", "z"))
    return f


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_gather_and_psum_roofline_and_grad(dtype):
    mesh = mesh_of((2, 2, 2), ("x", "y", "z"))
    specs = (P(None, "x"), P(None, ("y", "z")))
    args = inputs(mesh, specs, dtype)
    ref, ours = both(gather_matmul)
    assert {"jaxk3_all_gather", "jaxk3_psum"} <= primitives(
        jax.shard_map(ours, mesh=mesh, in_specs=specs, out_specs=P()), *args)
    run = partial(roofline.roofline_and_grad, mesh=mesh, in_specs=specs, out_specs=P())
    if dtype == jnp.int8:  # no gradient of an integer function: the forward only
        run = partial(roofline.roofline, mesh=mesh, in_specs=specs, out_specs=P())
        (_, r), (_, o) = run(ref)(*args), run(ours)(*args)
        assert_same(r, o, collective_axes=("x", "y", "z"))
        return
    (_, rf, rb), (_, of, ob) = run(ref)(*args), run(ours)(*args)
    assert_same(rf, of, collective_axes=("x", "y", "z"))
    assert_same(rb, ob, collective_axes=("x", "y", "z"))


@pytest.mark.parametrize("tiled,axis", [(False, 0), (False, 1), (True, 0), (True, -1)])
def test_gather_forms(tiled, axis):
    mesh = mesh_of((4, 2), ("x", "y"))
    spec = P("x", "y")
    args = inputs(mesh, (spec,), shape=(8, 16))
    ref, ours = both(lambda g, s: lambda a: g(jnp.sin(a), ("x", "y"), axis=axis, tiled=tiled))
    run = partial(roofline.roofline, mesh=mesh, in_specs=(spec,), out_specs=P(("x", "y")))
    (_, r), (_, o) = run(ref)(*args), run(ours)(*args)
    assert_same(r, o, collective_axes=("x", "y"))


def test_collective_matmul_with_remat():
    """roofline_test's fsdp pattern: a remat'ed gather before a matmul, and its gradient (the
    gather is recomputed in the backward pass, its transpose a reduce-scatter)."""
    mesh = mesh_of((2, 2, 2), ("x", "y", "z"))
    specs = (P("x", None), P("x", None))
    args = inputs(mesh, specs)

    def make(gather, psum):
        @jax.checkpoint
        def f(a, b):
            return a @ gather(b, "x", axis=0, tiled=True)
        return f

    ref, ours = both(make)
    run = partial(roofline.roofline_and_grad, mesh=mesh, in_specs=specs, out_specs=P("x", None))
    (_, rf, rb), (_, of, ob) = run(ref)(*args), run(ours)(*args)
    assert_same(rf, of, collective_axes=("x",))
    assert_same(rb, ob, collective_axes=("x",))


def test_size_one_axis_counts_zero_like_lax():
    mesh = mesh_of((1, 2, 4), ("x", "y", "z"))
    args = inputs(mesh, (P("z"),))
    ref, ours = both(lambda g, s: lambda a: s(g(g(a * 2, "x", axis=1, tiled=True), "y"), "z"))
    run = partial(roofline.roofline, mesh=mesh, in_specs=(P("z"),), out_specs=P("y", ("x", "z")))
    (_, r), (_, o) = run(ref)(*args), run(ours)(*args)
    assert o == r and r.ici_bytes["x"] == 0 and r.ici_bytes["y"] > 0 and r.ici_bytes["z"] > 0


def test_psum_without_the_type_check():
    """check_vma=False: lax.psum binds psum_p (not psum_invariant_p), ours binds
    jaxk3_psum[invariant=False]; the cost is lax's rule for psum_p, whatever jax has for it."""
    mesh = mesh_of((2, 4), ("x", "y"))
    spec = P("x", "y")
    (a,) = inputs(mesh, (spec,))

    def make(gather, psum):
        return _compat.call_shard_map(lambda v: psum(jnp.cos(v), ("x", "y")), mesh=mesh, in_specs=spec,
                                      out_specs=P(), check_vma=False)

    ref, ours = both(make)
    assert "jaxk3_psum" in primitives(ours, a)
    (_, r), (_, o) = roofline.roofline(ref, mesh=mesh)(a), roofline.roofline(ours, mesh=mesh)(a)
    assert o == r and r.unfused_hbm_bytes > 0  # (jax 0.10-0.12 have no rule for psum_p: no ICI either)


def test_rules_registered_once_and_idempotent():
    from jaxk3.collectives.allreduce import psum_p
    from jaxk3.collectives.gather import all_gather_p

    table = __import__("jax.experimental.roofline.roofline", fromlist=["_rooflines"])._rooflines
    rule = table[all_gather_p]
    assert rules.register() and table[all_gather_p] is rule and psum_p in table
