"""collectives.psum against its specification: the sum over the group in rank order, bfloat16 and
float16 accumulated in float32 and rounded once, the same bits on every rank; against an fp64
sum and lax.psum within that rounding; on random data (never zeros) with poisoned outputs; and signed
zeros bitwise equal to lax.psum."""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxk3 import collectives as C
from test_collectives_util import bits, poison_outputs, random_array  # noqa: F401 (autouse fixture)

ext = C.extension()
pytestmark = pytest.mark.skipif(ext is None, reason=f"jaxk3._ffi not built: {C.extension_error()}")

FLOATS = [jnp.bfloat16, jnp.float16, jnp.float32]
INTS = [jnp.int8, jnp.uint8, jnp.int16, jnp.int32, jnp.uint32]
SHAPES = [(1, 1), (1, 131), (3, 40), (2, 3, 5), (1, 1024), (7,)]
ORDERS = {2: [(1, 0)], 4: [(0, 1, 2, 3), (3, 1, 0, 2)], 8: [tuple(range(8)), (5, 2, 7, 0, 3, 6, 1, 4)]}
# Mantissa bits (with the implicit one) of each float dtype: its rounding is 2**-bits relative.
MANTISSA = {np.dtype(jnp.bfloat16): 8, np.dtype(np.float16): 11, np.dtype(np.float32): 24}


def make_mesh(order, names=("tp",), shape=None):
    devs = np.asarray(jax.devices())[list(order)]
    return jax.sharding.Mesh(devs.reshape(shape or (len(order),)), names)


def per_rank_sums(mesh, x, impl, axis_name="tp", spec=P("tp")):
    """Every rank's psum result, stacked along the first axis (check_vma off, so that each rank's
    copy comes back rather than one of them)."""
    f = jax.shard_map(lambda v: C.psum(v, axis_name, impl=impl), mesh=mesh, in_specs=(spec,), out_specs=spec,
                      check_vma=False)
    return np.asarray(jax.jit(f)(x))


def rank_order_sum(parts: np.ndarray, dtype) -> np.ndarray:
    """The specification: +0 + parts[0] + parts[1] + ... in float32 (int: wrapping), rounded once."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        return parts.astype(np.int64).sum(0).astype(dtype)
    acc = np.zeros(parts.shape[1:], np.float32)
    for p in parts:
        acc = acc + p.astype(np.float32)
    return acc.astype(dtype)


@pytest.mark.parametrize("n,order", [(n, o) for n, os in ORDERS.items() for o in os])
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=lambda d: jnp.dtype(d).name)
def test_rank_order_sum_bit_identical_on_every_rank(n, order, dtype):
    """Every rank holds the same bits, and they are the rank-order float32 sum rounded once;
    within that rounding of the fp64 sum; lax.psum agrees within it too (float16: XLA sums in
    float16) and exactly for integers."""
    mesh = make_mesh(order)
    for i, shape in enumerate(SHAPES):
        x = random_array(n * 1000 + i, (n * shape[0], *shape[1:]), dtype)
        x = jax.device_put(x, NamedSharding(mesh, P("tp")))
        got = per_rank_sums(mesh, x, "ffi").reshape(n, *shape)
        parts = np.asarray(x).reshape(n, *shape)
        for r in range(1, n):
            np.testing.assert_array_equal(bits(got[r]), bits(got[0]), err_msg=f"rank {r} differs, {shape}")
        np.testing.assert_array_equal(bits(got[0]), bits(rank_order_sum(parts, dtype)), err_msg=str(shape))
        ref = per_rank_sums(mesh, x, "lax").reshape(n, *shape)
        if np.issubdtype(np.dtype(dtype), np.integer):
            np.testing.assert_array_equal(got, ref)
            continue
        # Ours: float32 accumulation of n terms, then one rounding to the dtype:
        #   |ours - exact| <= n * 2**-24 * sum|x_i| + 2**-bits * |exact|
        # lax (XLA's CPU all-reduce) accumulates in the dtype itself (float16; bfloat16 and float32
        # came out bitwise equal to ours): |lax - exact| <= n * 2**-bits * sum|x_i|.
        f64 = parts.astype(np.float64)
        exact, mag, eps = f64.sum(0), np.abs(f64).sum(0), 2.0 ** -MANTISSA[np.dtype(dtype)]
        ours_bound = n * 2.0 ** -24 * mag + eps * np.abs(exact)
        assert np.all(np.abs(got[0].astype(np.float64) - exact) <= ours_bound * (1 + 1e-9)), shape
        lax_bound = ours_bound + n * eps * mag
        assert np.all(np.abs(got[0].astype(np.float64) - ref[0].astype(np.float64)) <= lax_bound * (1 + 1e-9)), shape


# Per column, the eight ranks' values (rows): every pattern of signed zeros a sum can meet.
_Z = -0.0
SIGNED_ZERO_COLUMNS = [
    [_Z] * 8,                          # all -0.0: lax sums from XLA's init +0.0, so +0.0
    [0.0] * 8,                         # all +0.0
    [_Z] + [0.0] * 7,                  # the first rank -0.0
    [0.0] + [_Z] * 7,                  # the first rank +0.0, the rest -0.0
    [_Z, 0.0] * 4,                     # alternating
    [0.0] * 7 + [_Z],                  # the last rank -0.0
    [_Z] * 7 + [1.5],                  # -0.0s and one value
    [_Z] * 7 + [-1.5],
    [1.5, -1.5] + [_Z] * 6,            # an exact cancellation, then -0.0s
    [_Z] * 6 + [-2.0, 2.0],
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("order", ORDERS[8], ids=lambda o: "in-order" if list(o) == sorted(o) else "permuted")
def test_signed_zeros_are_lax_bits(dtype, order):
    """Signed zeros, every rank holding -0.0 included: the same bits as lax.psum (XLA's CPU
    all-reduce sums from the init value +0.0, so all -0.0 gives +0.0), on every rank; outputs
    poisoned first (autouse fixture)."""
    with jax.enable_x64(np.dtype(dtype) == np.float64):
        mesh = make_mesh(order)
        cols = np.asarray(SIGNED_ZERO_COLUMNS, np.float64).T  # [8 ranks, columns]
        x = np.concatenate([cols, cols[:, ::-1]], axis=1).astype(dtype)  # [8, 20], one row per rank
        assert np.signbit(x).any() and np.count_nonzero(x) < x.size
        x = jax.device_put(x, NamedSharding(mesh, P("tp")))
        got, ref = per_rank_sums(mesh, x, "ffi"), per_rank_sums(mesh, x, "lax")
        assert got.dtype == ref.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(bits(got), bits(ref))
        assert not np.signbit(got[:, 0]).any()  # the all -0.0 column


@pytest.mark.parametrize("names", [("a", "b"), ("b", "a"), "a", "b"])
def test_tuple_axes_two_axis_mesh_and_pytrees(names):
    """Sums over a tuple of axes (any order: the same set of ranks, the rank order lax numbers)
    and over one axis of a 2-D mesh (one communicator per row or column); a pytree of mixed
    dtypes, every leaf bit-identical to the rank-order sum."""
    mesh = make_mesh((6, 1, 4, 3, 0, 7, 2, 5), names=("a", "b"), shape=(2, 4))
    spec = P(("a", "b"))
    tree = {"w": random_array(1, (8, 2, 33), jnp.float32),
            "b": [random_array(2, (8, 17), jnp.bfloat16),
                  random_array(3, (8, 5), jnp.int32)]}
    tree = jax.device_put(tree, NamedSharding(mesh, spec))

    def run(impl):
        f = jax.shard_map(lambda t: C.psum(t, names, impl=impl), mesh=mesh, in_specs=(spec,), out_specs=spec,
                          check_vma=False)
        return jax.jit(f)(tree)

    got, ref = run("ffi"), run("lax")
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_array_equal(bits(g), bits(r))  # float32/bfloat16/int32: lax sums in rank order too


def test_result_type_is_laxs_under_check_vma():
    """Under shard_map's type check the result is invariant over the summed axes (out_specs P()
    accepted) and varying over the others, like lax.psum's."""
    mesh = make_mesh(range(8), names=("a", "b"), shape=(2, 4))
    x = jax.device_put(random_array(4, (8, 16), jnp.float32), NamedSharding(mesh, P(("a", "b"))))
    types = {}

    def body(v, impl):
        s = C.psum(v, "b", impl=impl)
        types[impl] = (jax.typeof(s).shape, jax.typeof(s).dtype, jax.typeof(s).mat.varying)
        return C.psum(s, "a", impl=impl)

    outs = {impl: jax.jit(jax.shard_map(lambda v: body(v, impl), mesh=mesh, in_specs=(P(("a", "b")),),
                                        out_specs=P()))(x) for impl in ("ffi", "lax")}
    assert types["ffi"] == types["lax"] and types["lax"][2] == frozenset({"a"})
    np.testing.assert_array_equal(bits(outs["ffi"]), bits(outs["lax"]))


def test_fallback_reasons_and_strict_errors():
    mesh = make_mesh(range(4))

    def why(shape, dtype, impl="auto"):
        return C.explain(jax.ShapeDtypeStruct(shape, dtype), "tp", op="psum", impl=impl, mesh=mesh)

    assert why((1, 256), jnp.float32).path == "ffi" and why((1, 256), jnp.float32).target == C.ALL_REDUCE_TARGET
    assert "complex64" in why((1, 8), jnp.complex64).reason
    assert "bool" in why((1, 8), jnp.bool_).reason
    assert "rows" in why((65, 8), jnp.float32).reason
    assert C.explain(jax.ShapeDtypeStruct((1, 8), jnp.float32), "tp", op="psum", mesh=make_mesh([0])).path == "identity"

    class Gpu:  # a GPU mesh, as far as the plan looks at it: no CUDA all-reduce yet
        def __init__(self, i):
            self.id, self.process_index, self.local_hardware_id, self.platform = i, 0, i, "gpu"

    class GpuMesh:
        axis_names = ("tp",)
        devices = np.array([Gpu(i) for i in range(4)])

    p = C.explain(jax.ShapeDtypeStruct((1, 8), jnp.float32), "tp", op="psum", mesh=GpuMesh)
    assert p.path == "lax" and "no FFI all-reduce on CUDA" in p.reason
    x = jax.device_put(random_array(5, (4 * 100, 8), jnp.float32), NamedSharding(mesh, P("tp")))
    with pytest.raises(C.GatherUnavailableError, match="rows"):
        jax.jit(jax.shard_map(lambda v: C.psum(v, "tp", impl="ffi"), mesh=mesh, in_specs=(P("tp"),),
                              out_specs=P()))(x)
    # Forms lax serves: bool (lax sums int32), constants, positional axes, axis_index_groups.
    xb = jax.device_put(jnp.arange(8) % 3 == 0, NamedSharding(mesh, P("tp")))
    f = jax.jit(jax.shard_map(lambda v: (C.psum(v, "tp"), C.psum(2.0, "tp"),
                                         C.psum(v.astype(jnp.float32), ("tp", 0)),
                                         C.psum(v.astype(jnp.float32), "tp", axis_index_groups=[[0, 1], [2, 3]])),
                              mesh=mesh, in_specs=(P("tp"),), out_specs=(P(), P(), P(), P("tp")), check_vma=False))
    g = jax.jit(jax.shard_map(lambda v: (lax.psum(v, "tp"), lax.psum(2.0, "tp"),
                                         lax.psum(v.astype(jnp.float32), ("tp", 0)),
                                         lax.psum(v.astype(jnp.float32), "tp", axis_index_groups=[[0, 1], [2, 3]])),
                              mesh=mesh, in_specs=(P("tp"),), out_specs=(P(), P(), P(), P("tp")), check_vma=False))
    for a, b in zip(f(xb), g(xb)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_plain_shard_map_loop_and_nested_jit_take_the_fast_path():
    """The forms users write: a plain jax.shard_map in jax.jit, a fori_loop body, a nested jit
    called several times; the lowered HLO names the all-reduce and lax's all-reduce is gone;
    bitwise equal to lax (float32 on CPU: XLA sums in rank order too)."""
    mesh = make_mesh((2, 0, 3, 1))
    x = jax.device_put(random_array(6, (4, 64), jnp.float32), NamedSharding(mesh, P("tp")))

    def program(psum):
        inner = jax.jit(lambda v: psum(v * 0.5, "tp"))

        def body(v):
            s = psum(v, "tp")
            s = lax.fori_loop(0, 5, lambda i, c: jnp.tanh(psum(c * 0.25 + v, "tp")), s)
            return inner(s + v) + inner(s - v)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp")))

    text = program(C.psum).lower(x).as_text()
    assert text.count("jaxk3_all_reduce") >= 3 and "all_reduce" not in text.replace("jaxk3_all_reduce", "")
    np.testing.assert_array_equal(bits(program(C.psum)(x)), bits(program(lax.psum)(x)))


def test_10000_dependent_mixed_gathers_and_psums():
    """10,000 fori_loop steps, each a gather and a psum (of integer-valued float32, so exact),
    each checked on every rank against the value it must have; zero mismatches."""
    mesh = make_mesh((4, 6, 1, 7, 0, 3, 5, 2))
    n, cols, steps = 8, 48, 10_000

    def body(x):
        r = lax.axis_index("tp")
        x0_all = lax.all_gather(x, "tp", axis=0, tiled=True)  # the reference, by lax

        def step(i, carry):
            x, bad = carry
            g = C.all_gather(x, "tp", axis=0, tiled=True)  # [n, cols]: x0 rotated by i, plus i
            want = jnp.roll(x0_all, -(i % n), axis=0) + i.astype(jnp.float32)
            s = C.psum(x, "tp")  # the sum of the rotated rows is the sum of x0's rows, plus n*i
            want_s = jnp.sum(x0_all, axis=0, keepdims=True) + (n * i).astype(jnp.float32)
            bad = bad + jnp.sum(g != want).astype(jnp.int32) + jnp.sum(s != want_s).astype(jnp.int32)
            nxt = lax.dynamic_slice_in_dim(g, (r + 1) % n, 1, axis=0) + 1.0
            return nxt, bad

        bad0 = (r * 0).astype(jnp.int32)
        x, bad = lax.fori_loop(0, steps, step, (x, bad0))
        return x, bad[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=(P("tp"), P("tp"))))
    assert "jaxk3_all_reduce" in f.lower(jnp.zeros((n, cols))).as_text()
    x0 = np.random.default_rng(7).integers(-1000, 1000, (n, cols)).astype(np.float32)
    out, bad = f(jax.device_put(x0, NamedSharding(mesh, P("tp"))))
    assert int(np.asarray(bad).sum()) == 0
    np.testing.assert_array_equal(np.asarray(out), np.roll(np.asarray(x0), -(steps % n), axis=0) + steps)


def test_host_rendezvous_disagreeing_operation_fails_everywhere():
    """Ranks that meet in one round with different operations (a gather and its padded variant
    here) all get an error rather than a mixed result."""
    devices = [921, 922]
    results = [None, None]

    def run(r, align):
        try:
            results[r] = ext._host_gather_for_test(devices, 5, r, b"x" * 16, 11, align)
        except RuntimeError as e:
            results[r] = e

    ts = [threading.Thread(target=run, args=(0, 1)), threading.Thread(target=run, args=(1, 16))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert all(isinstance(r, RuntimeError) and "different operation" in str(r) for r in results), results
