"""The FFI gathers against lax.all_gather: bitwise, on random data, with poisoned outputs."""
from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxk3 import _compat
from jaxk3 import collectives as C
from jaxk3.collectives import groups, registry
from test_collectives_util import bits, poison_outputs, random_array  # noqa: F401 (autouse fixture)

ext = C.extension()
pytestmark = pytest.mark.skipif(ext is None, reason=f"jaxk3._ffi not built: {C.extension_error()}")

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32, jnp.int8, jnp.bool_]
# Per-rank shapes: one row and several, 16-byte aligned and not (131 and 264 bf16 columns
# are TP-sharded projection widths of K3), and a rank-3 array.
SHAPES = [(1, 1), (1, 131), (1, 264), (1, 1024), (3, 40), (2, 3, 5)]


def make_mesh(order, names=("tp",), shape=None):
    devs = np.asarray(jax.devices())[list(order)]
    return jax.sharding.Mesh(devs.reshape(shape or (len(order),)), names)


def gather_fn(mesh, in_spec, impl, *, axis, tiled, axis_name="tp", padded=False, donate=False):
    fn = C.padded_all_gather if padded else C.all_gather

    def body(xs):
        out = [fn(x, axis_name, axis=axis, tiled=tiled, impl=impl) for x in xs]
        if donate:  # same-shape outputs that XLA can place in the donated operands
            out += [x[::-1] for x in xs]
        return out

    f = C.shard_map(body, mesh=mesh, in_specs=(in_spec,), out_specs=in_spec)
    return jax.jit(f, donate_argnums=(0,) if donate else ())


def sharded_inputs(mesh, spec, n, seed):
    xs = []
    for i, (dt, shp) in enumerate((d, s) for d in DTYPES for s in SHAPES):
        global_shape = (shp[0] * n, *shp[1:])
        xs.append(jax.device_put(random_array(seed * 1000 + i, global_shape, dt), NamedSharding(mesh, spec)))
    return xs


ORDERS = {
    1: [(3,)],  # a group of one: the identity path
    2: [(0, 1), (1, 0)],
    4: [(0, 1, 2, 3), (3, 1, 0, 2)],
    8: [tuple(range(8)), (5, 2, 7, 0, 3, 6, 1, 4)],
}


@pytest.mark.parametrize("n,order", [(n, o) for n, os in ORDERS.items() for o in os])
@pytest.mark.parametrize("axis,tiled", [(0, False), (0, True), (-1, False), (-1, True)])
@pytest.mark.parametrize("padded", [False, True])
def test_bitwise_equal_to_lax(n, order, axis, tiled, padded):
    mesh = make_mesh(order)
    spec = P("tp")
    xs = sharded_inputs(mesh, spec, n, seed=n * 100 + axis + 7 * tiled)
    ref = gather_fn(mesh, spec, "lax", axis=axis, tiled=tiled)(xs)
    got = gather_fn(mesh, spec, "ffi", axis=axis, tiled=tiled, padded=padded)(xs)
    for x, r, g in zip(xs, ref, got):
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_array_equal(bits(g), bits(r), err_msg=f"{x.dtype} {x.shape} n={n} order={order}")


def test_lowered_hlo_names_the_path():
    mesh = make_mesh(range(4))
    xs = sharded_inputs(mesh, P("tp"), 4, seed=1)
    ffi_text = gather_fn(mesh, P("tp"), "auto", axis=-1, tiled=True).lower(xs).as_text()
    assert "jaxk3_one_shot_all_gather" in ffi_text  # aligned widths
    assert "jaxk3_padded_all_gather" in ffi_text  # 131 columns of bf16, 1 of f32, ...
    assert "all_gather" not in ffi_text.replace("jaxk3_one_shot_all_gather", "").replace("jaxk3_padded_all_gather", "")
    lax_text = gather_fn(mesh, P("tp"), "lax", axis=-1, tiled=True).lower(xs).as_text()
    assert "jaxk3_" not in lax_text and "all_gather" in lax_text


def test_donated_inputs_under_jit():
    mesh = make_mesh((2, 0, 3, 1))
    xs = sharded_inputs(mesh, P("tp"), 4, seed=3)
    ref = gather_fn(mesh, P("tp"), "lax", axis=0, tiled=True)(xs)
    flipped = [np.asarray(x).reshape(4, -1, *x.shape[1:])[:, ::-1].reshape(x.shape) for x in xs]
    got = gather_fn(mesh, P("tp"), "ffi", axis=0, tiled=True, donate=True)(xs)
    assert all(x.is_deleted() for x in xs)
    for r, g in zip(ref, got[: len(ref)]):
        np.testing.assert_array_equal(bits(g), bits(r))
    for f, g in zip(flipped, got[len(ref):]):
        np.testing.assert_array_equal(bits(g), bits(f))


@pytest.mark.parametrize("names", [("a", "b"), ("b", "a")])
def test_tuple_axes_and_two_axis_mesh(names):
    """Gathers over a tuple of axes (rank order as lax numbers it) and over one axis of a
    2-D mesh (two communicators of 4 devices, one per row)."""
    mesh = make_mesh((6, 1, 4, 3, 0, 7, 2, 5), names=("a", "b"), shape=(2, 4))
    spec = P(("a", "b"))
    x = jax.device_put(random_array(9, (8, 1, 40), jnp.bfloat16), NamedSharding(mesh, spec))

    def run(impl, axis_name):
        f = C.shard_map(lambda v: C.all_gather(v, axis_name, axis=1, tiled=True, impl=impl),
                        mesh=mesh, in_specs=(spec,), out_specs=spec)
        return jax.jit(f)(x)

    for axis_name in (names, "b", "a"):
        np.testing.assert_array_equal(bits(run("ffi", axis_name)), bits(run("lax", axis_name)))


def test_gather_logits_slices_padding():
    mesh = make_mesh(range(8))
    vocab, vpad = 1000, 1024
    logits = jax.device_put(random_array(5, (3, vpad), jnp.float32), NamedSharding(mesh, P(None, "tp")))

    def run(impl):
        f = C.shard_map(lambda v: C.gather_logits(v, "tp", vocab, impl=impl), mesh=mesh,
                        in_specs=(P(None, "tp"),), out_specs=P(), check_vma=False)
        return jax.jit(f, out_shardings=NamedSharding(mesh, P()))(logits)

    got, ref = run("ffi"), run("lax")
    assert got.shape == (3, vocab)
    np.testing.assert_array_equal(bits(got), bits(ref))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(logits)[:, :vocab])


# ---------------------------------------------------------------------------------------
# Fallback rules: each reason, decided statically.
# ---------------------------------------------------------------------------------------

def explain_in_mesh(shape, dtype, impl="auto", n=4, padded=False):
    mesh = make_mesh(range(n))
    return C.explain(jax.ShapeDtypeStruct(shape, dtype), "tp", impl=impl, padded=padded, mesh=mesh)


def test_fallback_reasons(monkeypatch):
    assert explain_in_mesh((1, 256), jnp.bfloat16).path == "ffi"
    assert explain_in_mesh((1, 256), jnp.bfloat16, n=1).path == "identity"
    assert "rows" in explain_in_mesh((65, 256), jnp.bfloat16).reason
    assert explain_in_mesh((65, 256), jnp.bfloat16).path == "lax"
    assert "dtype complex64" in explain_in_mesh((1, 8), jnp.complex64).reason
    assert "float8" in explain_in_mesh((1, 64), jnp.float8_e4m3fn).reason
    assert "impl='lax'" in explain_in_mesh((1, 8), jnp.float32, impl="lax").reason
    monkeypatch.setenv(C.ENV_MAX_BYTES, "1024")
    assert "bytes per rank" in explain_in_mesh((1, 512), jnp.float32).reason
    monkeypatch.setenv(C.ENV_MAX_ROWS, "1")
    assert "rows" in explain_in_mesh((2, 8), jnp.float32).reason


def test_fallback_no_handler_and_no_extension(monkeypatch):
    monkeypatch.setattr(registry, "_state", registry._State())
    monkeypatch.setattr(registry, "targets", lambda platform: {})
    with pytest.warns(RuntimeWarning, match="without cpu handlers"):
        p = explain_in_mesh((1, 8), jnp.float32)
    assert p.path == "lax" and "no cpu handler" in p.reason

    failed = registry._State()
    failed.loaded, failed.error = True, "the jaxk3._ffi extension failed to import (ImportError: test)"
    monkeypatch.setattr(registry, "_state", failed)
    with pytest.warns(RuntimeWarning, match="failed to import"):
        p = explain_in_mesh((1, 8), jnp.float32)
    assert p.path == "lax" and "failed to import" in p.reason


class FakeDevice:
    def __init__(self, id, process_index):
        self.id, self.process_index, self.local_hardware_id, self.platform = id, process_index, id % 4, "cpu"


def test_group_spanning_processes_is_detected():
    class FakeMesh:
        axis_names = ("dp", "tp")
        devices = np.array([[FakeDevice(i, i // 4) for i in range(4)], [FakeDevice(i, i // 4) for i in range(4, 8)]])

    spans_tp = groups.resolve(FakeMesh, ("tp",)).spans_processes
    spans_dp = groups.resolve(FakeMesh, ("dp",)).spans_processes
    assert not spans_tp and spans_dp
    p = C.plan((1, 8), jnp.float32, "dp", mesh=FakeMesh)
    assert p.path == "lax" and "spans processes" in p.reason


def test_impl_ffi_raises_with_reason_and_env_switch(monkeypatch):
    mesh = make_mesh(range(4))
    x = jax.device_put(random_array(0, (4 * 100, 8), jnp.float32), NamedSharding(mesh, P("tp")))
    with pytest.raises(C.GatherUnavailableError, match="rows"):
        jax.jit(C.shard_map(lambda v: C.all_gather(v, "tp", impl="ffi"), mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp")))(x)
    small = jax.device_put(random_array(0, (4, 8), jnp.float32), NamedSharding(mesh, P("tp")))
    f = lambda: jax.jit(C.shard_map(lambda v: C.all_gather(v, "tp"), mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp")))
    assert "jaxk3_" in f().lower(small).as_text()
    monkeypatch.setenv(C.ENV_IMPL, "lax")
    text = f().lower(small).as_text()
    assert "jaxk3_" not in text and "all_gather" in text
    monkeypatch.setenv(C.ENV_IMPL, "bogus")
    with pytest.raises(ValueError, match="JAXK3_GATHER"):
        f().lower(small)


def test_plain_shard_map_takes_the_fast_path():
    """Under a plain jax.shard_map in jax.jit (no wrapper, no jax.set_mesh) the devices are
    resolved when the program is lowered: the FFI path, and explain says so."""
    mesh = make_mesh((1, 0))
    x = jax.device_put(random_array(0, (2, 8), jnp.float32), NamedSharding(mesh, P("tp")))
    seen = []

    def body(v):
        seen.append(C.explain(v, "tp"))
        return C.all_gather(v, "tp", axis=0, tiled=True)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp")))
    assert "jaxk3_one_shot_all_gather" in f.lower(x).as_text()
    assert seen[0].path == "ffi" and "resolved when the program is lowered" in seen[0].reason
    ref = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, "tp", axis=0, tiled=True), mesh=mesh,
                                in_specs=(P("tp"),), out_specs=P("tp")))(x)
    np.testing.assert_array_equal(bits(f(x)), bits(ref))


# ---------------------------------------------------------------------------------------
# No hangs, no silent corruption.
# ---------------------------------------------------------------------------------------

def _threads(fns):
    results = [None] * len(fns)

    def run(i):
        try:
            results[i] = fns[i]()
        except Exception as e:  # noqa: BLE001
            results[i] = e

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return results


@pytest.fixture
def timeout_ms():
    """Sets the (process-wide) gather timeout for one test, before any thread starts."""
    saved = ext.timeout_ms()

    def set_(ms):
        ext.set_timeout_ms(ms)

    yield set_
    ext.set_timeout_ms(saved)


def test_host_rendezvous_missing_peer_times_out(timeout_ms):
    devices = [901, 902, 903]
    timeout_ms(300)
    t0 = time.monotonic()
    res = _threads([lambda r=r: ext._host_gather_for_test(devices, 1, r, b"abcd", 4, 1) for r in (0, 1)])
    assert time.monotonic() - t0 < 10
    for r in res:
        assert isinstance(r, RuntimeError) and "timed out" in str(r) and "arrived 2 of 3" in str(r)
    # The communicator is now broken: later calls fail at once, until reset().
    with pytest.raises(RuntimeError, match="unusable"):
        ext._host_gather_for_test(devices, 2, 0, b"abcd", 4, 1)
    C.reset()
    timeout_ms(5000)
    res = _threads([lambda r=r: ext._host_gather_for_test(devices, 3, r, bytes([r]) * 5, 4, 16) for r in range(3)])
    assert res == [b"\x00" * 5 + b"\x01" * 5 + b"\x02" * 5] * 3


def test_host_rendezvous_late_rank_fails_at_once_and_communicator_recovers(timeout_ms):
    """A rank that reaches a timed-out round late (XLA ran its launch only once the others had
    failed) gets the same error at once; after one timeout period the communicator works again
    without reset() (every rank passed the failed round, so generations still line up)."""
    devices = [921, 922, 923]
    timeout_ms(300)
    res = _threads([lambda r=r: ext._host_gather_for_test(devices, 1, r, b"abcd", 4, 1) for r in (0, 1)])
    assert all(isinstance(r, RuntimeError) and "timed out" in str(r) for r in res), res
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        ext._host_gather_for_test(devices, 1, 2, b"abcd", 4, 1)
    assert time.monotonic() - t0 < 0.25
    # Right after a timeout new rounds fail at once (queued launches must not each wait) ...
    with pytest.raises(RuntimeError, match="unusable for one timeout period"):
        ext._host_gather_for_test(devices, 2, 0, b"abcd", 4, 1)
    res = _threads([lambda r=r: ext._host_gather_for_test(devices, 2, r, b"abcd", 4, 1) for r in (1, 2)])
    assert all(isinstance(r, RuntimeError) and "unusable" in str(r) for r in res), res
    # ... and once the period is over, it works: no reset().
    time.sleep(0.4)
    res = _threads([lambda r=r: ext._host_gather_for_test(devices, 3, r, bytes([r]) * 5, 4, 16) for r in range(3)])
    assert res == [b"\x00" * 5 + b"\x01" * 5 + b"\x02" * 5] * 3


def test_host_rendezvous_disagreeing_ranks_fail_everywhere(timeout_ms):
    devices = [911, 912]
    timeout_ms(5000)
    res = _threads([
        lambda: ext._host_gather_for_test(devices, 1, 0, b"x" * 16, 11, 1),
        lambda: ext._host_gather_for_test(devices, 1, 1, b"y" * 32, 11, 1),
    ])
    assert all(isinstance(r, RuntimeError) and "disagree" in str(r) for r in res), res
    res = _threads([
        lambda: ext._host_gather_for_test(devices, 2, 0, b"x" * 16, 11, 1),
        lambda: ext._host_gather_for_test(devices, 2, 1, b"y" * 16, 4, 1),
    ])
    assert all(isinstance(r, RuntimeError) and "dtype" in str(r) for r in res), res


@pytest.mark.parametrize("target,out_shape,key", [(C.ONE_SHOT_TARGET, (2, 4), 7000),
                                                  (C.ALL_REDUCE_TARGET, (4,), 9000)])
def test_xla_missing_peer_errors_in_bounded_time(target, out_shape, key):
    """A program on one device whose gather (or all-reduce) names a 2-device group: the peer never
    comes."""
    d0, d1 = jax.devices()[:2]
    C.extension()
    registry.register("cpu")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32))
    table = np.array([d0.process_index, d0.id, 0, 0, d1.process_index, d1.id, 0, 1], np.int64)
    f = jax.jit(lambda v: call(v, site=np.int64(10**12), group_size=np.int64(2), table=table,
                               groups=np.array([d0.id + key, d1.id + key], np.int64)))
    saved = ext.timeout_ms()
    ext.set_timeout_ms(500)
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception, match="timed out"):
            jax.block_until_ready(f(jax.device_put(jnp.ones(4, jnp.float32), d0)))
        assert time.monotonic() - t0 < 30
    finally:
        ext.set_timeout_ms(saved)
        C.reset()


# ---------------------------------------------------------------------------------------
# Stress: thousands of dependent gathers, async dispatch, random sizes, several communicators.
# ---------------------------------------------------------------------------------------

def test_stress_async_dispatch_random_sizes():
    """4,800 dependent gathers of random widths over six communicators (the rows and columns of
    a permuted 2x4 mesh), two programs alternating, launched without waiting: up to 8 launches
    in flight, so a device may run step t+1 while its peers are still in step t.

    The window bounds how deep the async queue gets: jax's CPU client blocks one of its few
    threads per device launch, so an unbounded queue of multi-device launches with cross-device
    dependencies starves it (lax.all_gather then aborts the process; jaxk3 reports a timeout).
    """
    mesh = make_mesh((3, 6, 0, 5, 7, 2, 4, 1), names=("a", "b"), shape=(2, 4))
    spec = P(None, ("a", "b"))

    def make(impl, seed, chain=24):
        rng = np.random.default_rng(seed)
        steps = [(("b", "a")[i % 2], int(rng.integers(1, 300))) for i in range(chain)]

        def body(v):  # v: [1, 8] per device; each gather's output feeds the next
            for axis_name, width in steps:
                src = jnp.tile(v, (1, width // v.shape[1] + 1))[:, :width] * 1.5 + 0.5
                g = C.all_gather(src.astype(jnp.bfloat16), axis_name, axis=1, tiled=True, impl=impl)
                v = jnp.tanh(g[:, :8].astype(jnp.float32) - g[:, -8:].astype(jnp.float32) * 0.25)
            return v

        return jax.jit(C.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec))

    def run(impl, iters=100, window=4):
        f1, f2 = make(impl, 1), make(impl, 2)
        x = jax.device_put(random_array(0, (1, 64), jnp.float32), NamedSharding(mesh, spec))
        outs = []
        for i in range(iters):
            x = f2(f1(x))
            outs.append(x)
            if i % window == window - 1:
                x.block_until_ready()
        return outs

    got, ref = run("ffi"), run("lax")
    mismatches = sum(not np.array_equal(bits(g), bits(r)) for g, r in zip(got, ref))
    assert mismatches == 0
    assert len(got) * 2 * 24 == 4800


@pytest.mark.parametrize("in_spec", [P(), P("tp")])
def test_result_type_varies_like_lax(in_spec):
    """Under check_vma the FFI result has lax.all_gather's type (varying over the gathered axis),
    whether the operand varied or not, and the same values."""
    mesh = make_mesh(range(4))
    x = jax.device_put(random_array(2, (4, 8), jnp.float32), NamedSharding(mesh, in_spec))
    types = {}

    def run(impl):
        def body(v):
            g = C.all_gather(v, "tp", axis=0, tiled=True, impl=impl)
            types[impl] = _compat.varying_axes(g)
            return g

        return jax.jit(C.shard_map(body, mesh=mesh, in_specs=(in_spec,), out_specs=P("tp")))(x)

    np.testing.assert_array_equal(bits(run("ffi")), bits(run("lax")))
    assert types["ffi"] == types["lax"] == frozenset({"tp"})


def _nested_jit_program(K=32):
    """K calls of one nested jax.jit whose gather is lowered once and inlined K times (one call
    site, K instances), each behind uneven work, so that XLA's CPU runtime reaches them in a
    different order on different devices."""
    mesh = make_mesh(range(8))
    inner = jax.jit(lambda v: C.all_gather(v, "tp", axis=0, tiled=True))

    def body(w, *xs):
        outs = []
        for i, x in enumerate(xs):
            h = x
            for _ in range(1 + i % 4):  # uneven work before each gather
                h = jnp.tanh(h @ w)
            outs.append(inner(x + 0 * h[:, :4].sum()))
        return tuple(outs)

    f = jax.jit(C.shard_map(body, mesh=mesh, in_specs=(P(),) + (P("tp"),) * K, out_specs=(P(),) * K,
                            check_vma=False))
    w = jnp.eye(256, dtype=jnp.float32) * 0.5
    xs = [jnp.concatenate([jnp.full((8, 4), i, jnp.float32) + jnp.arange(8.0)[:, None] * 100,
                           jnp.zeros((8, 252))], 1) for i in range(K)]
    return f, w, xs


def _mismatches(f, w, xs, runs):
    return sum(not np.array_equal(np.asarray(o), np.asarray(x)) for _ in range(runs) for o, x in zip(f(w, *xs), xs))


def test_nested_jit_and_loop_bodies_take_the_fast_path_on_cpu():
    """The trap that made the CPU path refuse nested jits (formerly
    test_nested_jit_and_loop_bodies_fall_back_on_cpu): one call site, 32 instances, reached in a
    different order per device.  The CPU handlers match ranks by custom-call instance (one per
    inlined copy, the same on every device), so the form is safe: FFI path, exact results."""
    f, w, xs = _nested_jit_program()
    text = f.lower(w, *xs).as_text()
    assert text.count("jaxk3_one_shot_all_gather") == 1  # one call site (XLA inlines it 32 times)
    assert _mismatches(f, w, xs, runs=5) == 0


def test_nested_jit_trap_reproduces_when_matching_by_site():
    """The reproduction itself: with the old matching (by call site and per-device generation,
    a test switch now) the same program exchanges the wrong instances' data."""
    f, w, xs = _nested_jit_program()
    ext._set_match_by_site(True)
    try:
        bad = _mismatches(f, w, xs, runs=10)
    finally:
        ext._set_match_by_site(False)
        C.reset()
    if bad == 0:
        pytest.skip("XLA's CPU runtime ran the 32 instances in the same order on every device this time")
    assert bad > 0


def test_loop_bodies_and_cond_branches_take_the_fast_path():
    """fori_loop, scan and while_loop bodies and cond branches under a plain jax.shard_map: the
    FFI path (the lowered HLO names the targets), bitwise equal to lax."""
    mesh = make_mesh((3, 1, 0, 2))
    x = jax.device_put(random_array(4, (4, 24), jnp.float32), NamedSharding(mesh, P("tp")))

    def body(v, impl):
        def step(i, c):
            g = C.all_gather(c, "tp", axis=0, tiled=True, impl=impl)
            return jnp.tanh(jax.lax.dynamic_slice_in_dim(g, i % 4, 1) * 1.5 + C.psum(c, "tp", impl=impl) * 0.1)

        v = jax.lax.fori_loop(0, 7, step, v)
        v, _ = jax.lax.scan(lambda c, i: (step(i, c), None), v, jnp.arange(5))
        v = jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (step(c[1], c[0]), c[1] + 1), (v, 0))[0]
        return jax.lax.cond(v.sum() > 0, lambda u: step(1, u), lambda u: step(2, u), v)

    def run(impl):
        return jax.jit(jax.shard_map(lambda v: body(v, impl), mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp")))

    text = run("ffi").lower(x).as_text()
    assert "jaxk3_one_shot_all_gather" in text and "jaxk3_all_reduce" in text
    assert "all_gather(" not in text.replace("jaxk3_one_shot_all_gather(", "")
    got, ref = run("ffi")(x), run("lax")(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("raw", ["abc", "0", "-3", "-1", "inf", "-inf", "nan", "1e300"])
def test_bad_timeout_variable_is_a_clear_error(monkeypatch, raw):
    monkeypatch.setattr(registry, "_state", registry._State())
    monkeypatch.setenv(C.ENV_TIMEOUT, raw)
    with pytest.raises(ValueError, match="JAXK3_GATHER_TIMEOUT_S"):
        C.extension()


@pytest.mark.parametrize("name,raw", [(C.ENV_MAX_ROWS, "x"), (C.ENV_MAX_ROWS, "-1"), (C.ENV_MAX_BYTES, "1.5"),
                                      (C.ENV_MAX_BYTES, "-8"), (C.ENV_IMPL, "fast")])
def test_bad_size_and_impl_variables_are_clear_errors(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        explain_in_mesh((1, 8), jnp.float32)
