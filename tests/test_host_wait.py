"""How a rank of the CPU transport waits for its round (ffi/rank_wait.h): yielding the core,
asleep on its wait word, or as the yield gauge decides (ffi/yield_gauge.h: asleep while busy
threads of other processes share the run queue).  Each way gives the same bits as lax, a sleeping
rank that gives up waiting is completed later, a missing peer still times out, and a chain run
beside busy processes is still right.  (Timings on a shared CPU mean nothing here: docs/PERF.md
has the figures, from `jaxk3 bench gather --load N`.)"""
from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxk3 import collectives as C
from jaxk3.tools import bench_gather as bench
from test_collectives_util import bits, poison_outputs  # noqa: F401 (autouse fixture)

ext = C.extension()
pytestmark = pytest.mark.skipif(ext is None, reason=f"jaxk3._ffi not built: {C.extension_error()}")

MODES = ("yield", "sleep", "auto")


@pytest.fixture
def wait_mode():
    """Forces how waiting ranks wait, for one test."""
    yield ext._set_wait_mode
    ext._set_wait_mode("auto")


@pytest.fixture
def timeout_ms():
    saved = ext.timeout_ms()
    yield ext.set_timeout_ms
    ext.set_timeout_ms(saved)


def _chain(all_gather, psum, steps: int):
    """`steps` dependent gathers and psums in a lax.scan under a plain jax.shard_map on 8 devices;
    integer-valued float32, so every sum is exact and lax's bits are the reference."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8])[[3, 0, 6, 1, 7, 2, 5, 4]], ("tp",))

    def body(x):
        def step(c, i):
            g = all_gather(c, "tp", axis=1, tiled=True)  # [1, 8 * cols]
            s = psum(c, "tp")
            k = (lax.axis_index("tp") + i + 1) % 8
            nxt = lax.dynamic_slice_in_dim(g, k * c.shape[1], c.shape[1], axis=1) + jnp.roll(s, 1, axis=1) % 7
            return nxt, None

        return lax.scan(step, x, jnp.arange(steps))[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    x0 = np.random.default_rng(11).integers(-50, 50, (8, 40)).astype(np.float32)
    return f, jax.device_put(x0, NamedSharding(mesh, P("tp")))


@pytest.mark.parametrize("mode", MODES)
def test_every_way_of_waiting_gives_lax_bits(mode, wait_mode):
    wait_mode(mode)
    f, x = _chain(C.all_gather, C.psum, 300)
    assert "jaxk3_all_reduce" in f.lower(x).as_text()
    g, _ = _chain(lax.all_gather, lax.psum, 300)
    np.testing.assert_array_equal(bits(f(x)), bits(g(x)))


@pytest.mark.parametrize("mode", ("yield", "sleep"))
def test_a_rank_that_stops_waiting_is_completed_later(mode, wait_mode):
    """Rank 1 comes 50 ms after rank 0, which has stopped waiting (200 us) by then and returned
    its pending future: the last rank's combine is handed to it by a worker thread."""
    wait_mode(mode)
    devices = [951, 952]
    out = [None, None]

    def run(r):
        if r:
            time.sleep(0.05)
        out[r] = ext._host_gather_for_test(devices, 1, r, bytes([r + 1]) * 6, 4, 1)

    ts = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert out == [b"\x01" * 6 + b"\x02" * 6] * 2


def test_sleeping_ranks_time_out_when_a_peer_never_comes(wait_mode, timeout_ms):
    """Ranks asleep in their round when a peer never comes: the timeout names it, and the
    communicator works again after reset()."""
    wait_mode("sleep")
    timeout_ms(300)
    devices = [961, 962, 963]
    errors = [None, None]

    def run(r):
        try:
            ext._host_gather_for_test(devices, 1, r, b"abcd", 4, 1)
        except RuntimeError as e:
            errors[r] = str(e)

    t0 = time.monotonic()
    ts = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert time.monotonic() - t0 < 10
    assert all(e and "timed out" in e and "missing ranks [2]" in e for e in errors), errors
    C.reset()
    timeout_ms(5000)
    out = [None] * 3

    def again(r):
        out[r] = ext._host_gather_for_test(devices, 2, r, bytes([r]) * 3, 4, 1)

    ts = [threading.Thread(target=again, args=(r,)) for r in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert out == [b"\x00" * 3 + b"\x01" * 3 + b"\x02" * 3] * 3


def test_chain_beside_busy_processes(wait_mode):
    """The gauge's own choice (auto) with two busy processes on the machine, as `jaxk3 bench
    gather --load 2` runs: still lax's bits."""
    wait_mode("auto")
    f, x = _chain(C.all_gather, C.psum, 300)
    g, _ = _chain(lax.all_gather, lax.psum, 300)
    want = g(x)
    with bench.busy_load(2):
        got = f(x)
        got.block_until_ready()
    np.testing.assert_array_equal(bits(got), bits(want))


def test_yield_gauge_sleeps_after_slow_yields_and_probes_its_way_back():
    """The policy of ffi/yield_gauge.h on made-up yields and times (microseconds): three slow
    (>= 0.5 ms) yields in a row on a rank put waiters to sleep, fewer do not; while asleep, one
    probe per 100 ms; sixteen fast probes in a row and waiters yield again, a slow one starts
    the count over.  A slow yield during which this process's threads ran >= 0.9 of its wall time
    (the core went to a peer of this process) neither counts nor breaks a run; such a probe is
    fast.  `waiters_sleeping` reports the gauge, and `jaxk3 bench gather` prints it."""
    def g(steps):  # (what, took, at[, own cpu]): no own CPU time unless given
        return ext._yield_gauge_for_test([tuple(s) + (0.0,) * (4 - len(s)) for s in steps])
    slow, fast = 3000.0, 30.0
    assert g([("yield", slow, 0), ("yield", slow, 1e3), ("yield", 499.0, 2e3), ("yield", slow, 3e3),
              ("yield", slow, 4e3), ("how", 0, 5e3)]) == ["yield"]
    asleep = [("yield", slow, 0), ("yield", slow, 1e3), ("yield", slow, 2e3)]
    assert g(asleep + [("how", 0, 3e3), ("how", 0, 90e3), ("how", 0, 102e3), ("how", 0, 150e3),
                       ("how", 0, 203e3)]) == ["sleep", "sleep", "probe", "sleep", "probe"]
    probes = [("probe", fast, 0)] * 15 + [("probe", slow, 0)] + [("probe", fast, 0)] * 15
    assert g(asleep + probes + [("how", 0, 3e3)]) == ["sleep"]
    assert g(asleep + probes + [("probe", fast, 0), ("how", 0, 3e3)]) == ["yield"]
    assert g([("how", 0, 0)]) == ["yield"]  # each call starts, and leaves, a fresh gauge
    # the core to this process's own threads: slow yields with own CPU time >= 0.9 of the wall time
    own = [("yield", slow, 0, 0.9 * slow), ("yield", slow, 1e3, 1.8 * slow), ("yield", slow, 2e3, slow)]
    assert g(own * 3 + [("how", 0, 1e4)]) == ["yield"]
    assert g([own[0], ("yield", slow, 1e3, 0.85 * slow), ("yield", slow, 2e3), own[1], ("yield", slow, 3e3),
              ("how", 0, 4e3)]) == ["sleep"]  # an own one between foreign ones neither counts nor resets
    own_probes = [("probe", slow, 0, slow)] * 8 + [("probe", fast, 0)] * 8
    assert g(asleep + own_probes + [("how", 0, 3e3)]) == ["yield"]
    assert g(asleep + own_probes[:-1] + [("probe", slow, 0, 0.5 * slow), ("how", 0, 3e3)]) == ["sleep"]
    assert g(asleep + [("how", 0, 3e3)]) == ["sleep"] and ext.waiters_sleeping() is False  # left fresh
    try:
        assert ext._yield_gauge_for_test([s + (0.0,) for s in asleep], keep=True) == []
        assert ext.waiters_sleeping() is True
        r = bench.bench_collectives(sizes=(64,), chain=2, repeats=1, devices=jax.devices()[:8], impls=("ffi",))
        assert r["cpu_waiters"] == "asleep"  # (16 fast probes at one per 100 ms to wake: not within this run)
        assert "CPU waiters asleep at the end" in bench.gather_table(r)
    finally:
        ext._yield_gauge_for_test([("how", 0, 0, 0)])
    assert ext.waiters_sleeping() is False
    r = bench.bench_collectives(sizes=(64,), chain=2, repeats=1, devices=jax.devices()[:8], impls=("ffi",))
    assert r["cpu_waiters"] in ("yielding", "asleep")  # asleep only if busy threads of other processes took cores
