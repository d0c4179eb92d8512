"""The CUDA one-shot / padded gathers against lax.all_gather, on the GPUs of this process.

Run on a machine with >= 2 GPUs, with JAX on CUDA (conftest defaults JAX_PLATFORMS to cpu,
so set it):  JAX_PLATFORMS=cuda python -m pytest tests/test_gpu_gathers.py -m gpu
scripts/gpu_check.sh does that, builds the extension first and also runs the benchmark.

Command buffers (CUDA graphs) are XLA flags, read once per process: the tests that need
other flags run this file again in a subprocess (JAXK3_GPU_SUBPROCESS marks the child).
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxk3 import collectives as C

pytestmark = pytest.mark.gpu


def _gpus():
    try:
        return jax.devices("gpu")
    except Exception:
        return []


def _skip_reason() -> str | None:
    gpus = _gpus()
    if len(gpus) < 2:
        return f"needs >= 2 GPUs visible to jax (found {len(gpus)}; JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r})"
    ext = C.extension()
    if ext is None:
        return f"jaxk3._ffi not built: {C.extension_error()}"
    if not ext.build_info().get("ffi_cuda") or not dict(ext.cuda_targets()):
        return "this jaxk3 build has no CUDA handlers (build with JAXK3_CUDA=ON)"
    return None


_REASON = _skip_reason()
requires_gpus = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _one_gpu_skip_reason() -> str | None:
    if not _gpus():
        return f"needs a GPU visible to jax (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r})"
    ext = C.extension()
    if ext is None:
        return f"jaxk3._ffi not built: {C.extension_error()}"
    if not ext.build_info().get("ffi_cuda"):
        return "this jaxk3 build has no CUDA handlers (build with JAXK3_CUDA=ON)"
    return None


_ONE_REASON = _one_gpu_skip_reason()
requires_one_gpu = pytest.mark.skipif(_ONE_REASON is not None, reason=_ONE_REASON or "")


def random_array(key, shape, dtype):
    """Random normal data (never zeros in practice), scaled so that the bits vary."""
    x = jax.random.normal(key, shape, jnp.float32) * 3 + 0.5
    x = jnp.where(x == 0, 1.0, x)
    return x.astype(dtype)


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def mesh_of(devices, names=("tp",), shape=None):
    devs = np.asarray(devices, dtype=object)
    return jax.sharding.Mesh(devs.reshape(shape or (len(devices),)), names)


def gather_fn(mesh, impl, *, padded=False):
    fn = C.padded_all_gather if padded else C.all_gather

    def body(x):
        return fn(x, "tp", axis=x.ndim - 1, tiled=True, impl=impl)

    return jax.jit(C.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


# Per-rank shapes and dtypes: one row and several; 16-byte aligned widths and not (131, 1055
# bf16 columns); 64 B to 256 KB per rank.
CASES = [
    ((1, 16), jnp.float32),      # 64 B
    ((1, 33), jnp.bfloat16),     # 66 B, unaligned
    ((1, 131), jnp.bfloat16),    # 262 B, unaligned (a TP projection width)
    ((1, 264), jnp.bfloat16),    # 528 B
    ((3, 77), jnp.float16),      # 462 B, 3 rows, unaligned
    ((1, 37), jnp.int8),         # 37 B: odd, byte tails
    ((1, 1056), jnp.bfloat16),   # 2112 B: q_a ⊕ kv_a latent over 2
    ((4, 1024), jnp.float32),    # 16 KB, 4 rows
    ((1, 7001), jnp.float16),    # 14002 B, unaligned
    ((8, 8192), jnp.bfloat16),   # 128 KB, 8 rows
    ((1, 65536), jnp.float32),   # 256 KB
    ((1, 131071), jnp.bfloat16), # ~256 KB, unaligned
]


@requires_gpus
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("shape,dtype", CASES, ids=[f"{s[0]}x{s[1]}-{jnp.dtype(d).name}" for s, d in CASES])
def test_bitwise_equal_to_lax(shape, dtype, padded):
    gpus = _gpus()
    n = len(gpus)
    mesh = mesh_of(gpus)
    rows, cols = shape
    x = jax.device_put(random_array(jax.random.key(rows * 7919 + cols), (n * rows, cols), dtype),
                       NamedSharding(mesh, P("tp")))
    plan = C.explain(jax.ShapeDtypeStruct(shape, dtype), "tp", axis=1, tiled=True, impl="ffi",
                     padded=padded, mesh=mesh)
    assert plan.path == "ffi", plan.reason
    for _ in range(3):  # repeated calls reuse the communicator's slots
        got = gather_fn(mesh, "ffi", padded=padded)(x)
        want = gather_fn(mesh, "lax")(x)
        assert got.shape == want.shape == (n * rows, n * cols)
        np.testing.assert_array_equal(bits(got), bits(want))
    # and against NumPy: every rank holds the rank-major concatenation
    host = np.asarray(x).reshape(n, rows, cols)
    expect = np.concatenate(list(host), axis=1)
    for r in range(n):
        np.testing.assert_array_equal(bits(np.asarray(got)[r * rows:(r + 1) * rows]), bits(expect))


def _chain(mesh, n, cols, steps, impl):
    """`steps` dependent gathers in a fori_loop; counts mismatching elements on the way.

    Rank r starts with x0[r]; step i gathers every rank's x, checks it equals x0 rotated by i
    plus i, and takes the next rank's slice plus one (exact in f32 for < 2**24 steps)."""

    def body(x):
        r = lax.axis_index("tp")
        x0_all = lax.all_gather(x, "tp", axis=0, tiled=True)  # [n, cols], the reference

        def step(i, carry):
            x, bad = carry
            g = C.all_gather(x, "tp", axis=0, tiled=True, impl=impl)  # [n, cols]
            want = jnp.roll(x0_all, -(i % n), axis=0) + i.astype(jnp.float32)
            bad = bad + jnp.sum(g != want).astype(jnp.int32)
            nxt = lax.dynamic_slice_in_dim(g, (r + 1) % n, 1, axis=0) + 1.0
            return nxt, bad

        bad0 = (r * 0).astype(jnp.int32)  # varying over "tp", like the loop's output
        x, bad = lax.fori_loop(0, steps, step, (x, bad0))
        return x, bad[None]

    return jax.jit(C.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=(P("tp"), P("tp"))))


@requires_gpus
@pytest.mark.parametrize("cols", [256, 1056 // 2 * 2 + 1])  # 1 KB aligned, 4228 B unaligned
def test_10000_dependent_gathers(cols):
    gpus = _gpus()
    n = len(gpus)
    mesh = mesh_of(gpus)
    steps = 10_000
    x0 = jax.random.randint(jax.random.key(cols), (n, cols), -1000, 1000).astype(jnp.float32)
    x = jax.device_put(x0, NamedSharding(mesh, P("tp")))
    out, bad = _chain(mesh, n, cols, steps, "ffi")(x)
    assert int(np.asarray(bad).sum()) == 0
    expect = np.roll(np.asarray(x0), -(steps % n), axis=0) + steps
    np.testing.assert_array_equal(np.asarray(out), expect)
    # once more: the epochs carry on from the first run
    out2, bad2 = _chain(mesh, n, cols, steps, "ffi")(x)
    assert int(np.asarray(bad2).sum()) == 0
    np.testing.assert_array_equal(np.asarray(out2), expect)


@requires_gpus
def test_unrolled_chain_matches_lax():
    """100 gathers unrolled in one jit, each feeding the next (what the benchmark times)."""
    gpus = _gpus()
    n = len(gpus)
    mesh = mesh_of(gpus)
    cols = 131

    def body(x):
        for i in range(100):
            g = C.all_gather(x, "tp", axis=1, tiled=True, impl=impl)
            k = (i + 1) % n
            x = g[:, k * cols:(k + 1) * cols] * 1.5
        return x

    x = jax.device_put(random_array(jax.random.key(3), (n, cols), jnp.bfloat16), NamedSharding(mesh, P("tp")))
    outs = {}
    for impl in ("ffi", "lax"):
        outs[impl] = jax.jit(C.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(x)
    np.testing.assert_array_equal(bits(outs["ffi"]), bits(outs["lax"]))


@requires_gpus
def test_two_communicators():
    """Two communicators at once.  With >= 4 GPUs: one program on a (n/2, 2) mesh gathering over
    the size-2 axis (n/2 groups, each its own communicator).  With 2 GPUs a jit takes one device
    order, so: the GPUs forward and reversed (two ordered groups, two communicators) in two
    programs, dispatched interleaved without waiting, several times."""
    gpus = _gpus()
    n = len(gpus)
    cols = 300

    def gather_prog(mesh, axis, impl):
        def body(x):
            a = C.all_gather(x, axis, axis=1, tiled=True, impl=impl)
            return C.all_gather(a[:, :cols] + 1, axis, axis=1, tiled=True, impl=impl)

        return jax.jit(C.shard_map(body, mesh=mesh, in_specs=P(mesh.axis_names), out_specs=P(mesh.axis_names)))

    if n >= 4:
        m = n // 2 * 2
        mesh = mesh_of(gpus[:m], ("dp", "tp"), (m // 2, 2))
        x = jax.device_put(random_array(jax.random.key(5), (m, cols), jnp.float32),
                           NamedSharding(mesh, P(("dp", "tp"))))
        got = gather_prog(mesh, "tp", "ffi")(x)
        want = gather_prog(mesh, "tp", "lax")(x)
        np.testing.assert_array_equal(bits(got), bits(want))
        return

    fwd, rev = mesh_of(gpus), mesh_of(gpus[::-1])
    xs = {k: jax.device_put(random_array(jax.random.key(i), (n, cols), jnp.float32), NamedSharding(m, P("tp")))
          for i, (k, m) in enumerate((("fwd", fwd), ("rev", rev)))}
    progs = {(k, impl): gather_prog(m, "tp", impl) for k, m in (("fwd", fwd), ("rev", rev)) for impl in ("ffi", "lax")}
    want = {k: np.asarray(progs[(k, "lax")](xs[k])) for k in xs}
    outs = []
    for _ in range(20):  # both communicators' kernels queued on the same GPU streams
        outs.append(("fwd", progs[("fwd", "ffi")](xs["fwd"])))
        outs.append(("rev", progs[("rev", "ffi")](xs["rev"])))
    for k, o in outs:
        np.testing.assert_array_equal(bits(o), bits(want[k]))


@requires_gpus
def test_one_gpu_group_is_identity():
    gpus = _gpus()
    mesh = mesh_of(gpus[:1])
    x = jax.device_put(random_array(jax.random.key(7), (1, 131), jnp.bfloat16), NamedSharding(mesh, P("tp")))
    plan = C.explain(jax.ShapeDtypeStruct((1, 131), jnp.bfloat16), "tp", axis=1, tiled=True, impl="ffi", mesh=mesh)
    assert plan.path == "identity"
    got = gather_fn(mesh, "ffi")(x)
    np.testing.assert_array_equal(bits(got), bits(x))
    # a one-GPU group is a valid CUDA group (no communicator is made for it)
    assert C.extension().cuda_group_ok([int(gpus[0].id)])[0]


@requires_gpus
def test_cuda_group_ok():
    ext = C.extension()
    ids = [int(d.id) for d in _gpus()]
    ok, why = ext.cuda_group_ok(ids)
    assert ok, why
    ok, why = ext.cuda_group_ok([ids[0], ids[0]])
    assert not ok and "twice" in why
    ok, why = ext.cuda_group_ok([ids[0], 10_000])
    assert not ok


@requires_gpus
def test_missing_peer_fails_in_bounded_time():
    """A rank whose peer never arrives stops waiting after the timeout and reports it."""
    ext = C.extension()
    ordinals = [int(d.local_hardware_id) for d in _gpus()[:2]]
    msg, ms = ext._cuda_lonely_gather_for_test(ordinals, 300)
    assert "timeout" in msg, msg
    assert 250 <= ms < 5000, ms
    # the private communicator stays broken: the next kernel gives up at once
    msg2, ms2 = ext._cuda_lonely_gather_for_test(ordinals, 300)
    assert "timeout" in msg2 and ms2 < 250, (msg2, ms2)


@requires_gpus
def test_two_streams_on_one_communicator_is_reported():
    """Two kernels of one communicator overlapping on a GPU (two streams) give an error, not
    silent corruption or an endless wait."""
    ext = C.extension()
    ordinals = [int(d.local_hardware_id) for d in _gpus()[:2]]
    msg, ms = ext._cuda_lonely_gather_for_test(ordinals, 300, two_streams=True)
    assert "two streams" in msg, msg
    assert ms < 5000, ms


@requires_one_gpu
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("nbytes", [4, 66, 262, 4099, 65536])
def test_kernel_protocol_on_one_gpu(n, nbytes):
    """The one-shot kernel's protocol (flags, two receive slots, epochs, 16-byte padding) with n
    ranks of one communicator on one GPU, each rank's kernel on its own stream: every output byte
    checked on the host over 6 calls in a row (both slots, three epochs each)."""
    ordinal = int(_gpus()[0].local_hardware_id)
    assert C.extension()._cuda_shared_gpu_gather_for_test(ordinal, n, nbytes, 6) == ""


@requires_one_gpu
def test_local_tile_floor_on_gpu():
    """jaxk3_local_tile (the benchmark's ffi_floor) writes what jnp.tile writes."""
    x = random_array(jax.random.key(11), (2, 37), jnp.bfloat16)
    got = jax.jit(lambda v: C.local_tile(v, 3, axis=1, tiled=True))(jax.device_put(x, _gpus()[0]))
    np.testing.assert_array_equal(bits(got), bits(jnp.tile(x, (1, 3))))


@requires_gpus
def test_plain_shard_map_loops_and_nested_jit_on_gpu():
    """The forms users write, under a plain jax.shard_map: the FFI gathers in the lowered HLO,
    bitwise equal to lax; psum is lax's on CUDA (no CUDA all-reduce yet), and explain says so."""
    gpus = _gpus()
    mesh = mesh_of(gpus)
    n, cols = len(gpus), 131
    seen = []

    def program(gather):
        inner = jax.jit(lambda v: gather(v, "tp", axis=1, tiled=True))

        def body(x):
            seen.append(C.explain(x, "tp", op="psum"))
            x = lax.fori_loop(0, 5, lambda i, v: inner(v)[:, :cols] * 1.25, x)
            y, _ = lax.scan(lambda c, i: (gather(c, "tp", axis=1, tiled=True)[:, cols:2 * cols] + 1, None), x,
                            jnp.arange(3))
            return inner(y)[:, :cols] + C.psum(y, "tp")

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))

    x = jax.device_put(random_array(jax.random.key(12), (n, cols), jnp.bfloat16), NamedSharding(mesh, P("tp")))
    text = program(C.all_gather).lower(x).as_text()
    assert "jaxk3_padded_all_gather" in text and "jaxk3_all_reduce" not in text
    assert seen[0].path == "lax" and "CUDA" in seen[0].reason
    np.testing.assert_array_equal(bits(program(C.all_gather)(x)), bits(program(lax.all_gather)(x)))


def _rerun_with_flags(xla_flags: str, select: str):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    env["JAXK3_GPU_SUBPROCESS"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", select]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


_SUBSET = "test_10000_dependent_gathers or test_unrolled_chain or test_two_communicators or (test_bitwise and (1x131 or 1x37 or 1x65536 or 8x8192))"


@requires_gpus
@pytest.mark.skipif(os.environ.get("JAXK3_GPU_SUBPROCESS") == "1", reason="already the subprocess")
def test_under_command_buffers():
    """The same checks with the gathers captured into CUDA graphs (replayed, handler not called)."""
    _rerun_with_flags("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL "
                      "--xla_gpu_graph_min_graph_size=1", _SUBSET)


@requires_gpus
@pytest.mark.skipif(os.environ.get("JAXK3_GPU_SUBPROCESS") == "1", reason="already the subprocess")
def test_without_command_buffers():
    _rerun_with_flags("--xla_gpu_enable_command_buffer=", _SUBSET)
