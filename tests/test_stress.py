"""Load that used to abort the process (issue 15): long prompts, several threads with several
models, on 8 CPU devices.  Every run must finish and equal the serial run; the test is bounded in
time by its sizes (tiny models, a few dispatches per call)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import jaxk3
from conftest import CHILD_XLA_FLAGS
from jaxk3.config import KimiK3Config


@pytest.mark.slow  # the first suite only: the newest jax takes the same chunked prefill at TP 8 in test_generation
def test_long_prompt_at_tp8_does_not_abort():
    """300 prompt tokens at TP 8 (the token-by-token path queued 300 steps and XLA aborted at ~200)."""
    m = jaxk3.init_random_model(KimiK3Config.tiny_k3(), seed=0, tp=8)
    out = m.generate([list(range(1, 301))], 4)
    assert out.tokens.shape == (1, 4) and out.prompt_tokens == 512


def test_threads_with_models_equal_serial_runs():
    """4 threads x 4 models (TP 8, 300-token prompts), each generating concurrently, equal the serial runs."""
    cfg = KimiK3Config.tiny_k3()
    models = [jaxk3.init_random_model(cfg, seed=s, tp=8) for s in range(4)]
    prompts = [list(np.random.default_rng(s).integers(0, 1000, 300)) for s in range(4)]
    serial = [m.generate([p], 4).tokens for m, p in zip(models, prompts)]
    got, errors = [None] * 4, []

    def work(i):
        try:
            got[i] = models[i].generate([prompts[i]], 4).tokens
        except Exception as e:  # reported below; a crash of the process would fail the run outright
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for a, b in zip(got, serial):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_prefill_on_two_cpu_devices_finishes(tmp_path):
    """A 2-device process: the KDA prefill once used XLA's CPU triangular solve (a LAPACK custom
    call), which starved the 2-thread runtime and hung forever; `jaxk3 bench generate` runs the
    prefill and the decode loop end to end here, bounded by the subprocess timeout.  The model is the
    tiny K3's first four layers (tests/small_models.py, given to --config as a config.json: three KDA
    layers and an MLA one, each prefilled in two 64-token chunks): the hang was per KDA prefill, and
    the bench's compiles and random weights cost half the 8-layer model's."""
    import json
    import subprocess
    import sys

    from small_models import tiny_k3_4l

    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_k3_4l().to_hf_dict()))
    cmd = [sys.executable, "-m", "jaxk3.cli", "bench", "generate", "--cpu-devices", "2", "--config", str(config),
           "--tp", "2", "--batch", "1", "--prompt", "70", "--new", "4", "--prefill-chunk", "64", "--decode-chunk", "3",
           "--copy-mb", "1"]  # the default 1 GiB per device bandwidth copy took 2 of this test's 3.5 minutes
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)  # several tiny compiles
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TTFT s" in r.stdout and "decode tok/s" in r.stdout and "TTFT floor s" in r.stdout
    assert "(4 layers, " in r.stdout, r.stdout[-2000:]  # the config file, not a preset


_UNAWAITED = r"""
import os, sys, time
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # the test gives its own
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxk3.collectives as C

mesh = jax.make_mesh((8,), ("tp",))
def sm(body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P(), check_vma=False))
fns = [sm(lambda x: C.all_gather(x, "tp", tiled=True)),
       sm(lambda x: C.psum(x, "tp")),
       sm(lambda x: C.psum(C.all_gather(x, "tp", tiled=True), "tp"))]
xs = [jax.device_put(jnp.arange(64, dtype=jnp.float32) * (1 + i % 7) - i, NamedSharding(mesh, P("tp")))
      for i in range(int(sys.argv[1]))]
for f in fns:  # compiled, and through the FFI (not lax)
    assert "jaxk3_" in f.lower(xs[0]).as_text(), f.lower(xs[0]).as_text()
    f(xs[0]).block_until_ready()
t0 = time.perf_counter()
queued = [fns[i % 3](x) for i, x in enumerate(xs)]  # nothing awaited
got = [np.asarray(r) for r in queued]
t_queued = time.perf_counter() - t0
serial = [np.asarray(fns[i % 3](x).block_until_ready()) for i, x in enumerate(xs)]
bad = [i for i, (a, b) in enumerate(zip(got, serial)) if a.dtype != b.dtype or a.tobytes() != b.tobytes()]
print("POOL", C.cpu_pool.STATUS)
print("QUEUED", len(got), "MISMATCHED", len(bad), "SECONDS %.2f" % t_queued)
"""


def test_2000_unawaited_jitted_gathers_and_psums_equal_serial_runs():
    """2,000 jitted calls (gathers, psums, gather+psum, alternating) on 8 CPU devices, dispatched
    without waiting, then awaited: every result equals its serial run bitwise, none times out,
    the process does not abort.  jaxlib 0.10 needed its CPU pool sized (collectives/cpu_pool.py:
    with 8 threads the 33rd queued launch starved the running one).  A subprocess, so a
    regression fails within the timeout instead of hanging the suite."""
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["JAXK3_GATHER_TIMEOUT_S"] = "20"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {CHILD_XLA_FLAGS}"  # and the tests' level (conftest)
    r = subprocess.run([sys.executable, "-c", _UNAWAITED, "2000"], capture_output=True, text=True, timeout=240,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "QUEUED 2000 MISMATCHED 0" in r.stdout, r.stdout + r.stderr[-3000:]


_STARVED = r"""
import os, sys, time
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # the test gives its own
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxk3.collectives as C

mesh = jax.make_mesh((8,), ("tp",))
f = jax.jit(jax.shard_map(lambda x: C.psum(C.all_gather(x, "tp", tiled=True), "tp"), mesh=mesh,
                          in_specs=P("tp"), out_specs=P(), check_vma=False))
x = jax.device_put(jnp.arange(32, dtype=jnp.float32), NamedSharding(mesh, P("tp")))
ref = np.asarray(f(x))
failed, errors = 0, set()
for r in [f(x) for _ in range(300)]:
    try:
        assert np.array_equal(np.asarray(r), ref)
    except jax.errors.JaxRuntimeError as e:
        failed += 1
        errors.add(str(e).split(":")[0])
print("FAILED", failed, sorted(errors))
time.sleep(float(os.environ["JAXK3_GATHER_TIMEOUT_S"]) + 0.5)
later = [f(x) for _ in range(20)] + [f(x).block_until_ready() for _ in range(5)]
print("LATER_OK", all(np.array_equal(np.asarray(r), ref) for r in later))
"""


def test_starved_cpu_pool_fails_cleanly_and_recovers_without_reset():
    """The pool jaxk3 cannot size (PJRT_NPROC=8 set by the user, or jax's CPU client made before
    jaxk3 was imported): on jaxlib 0.10, 300 queued launches starve the running one.  Then a
    launch fails with DEADLINE_EXCEEDED, those queued behind it fail at once (FAILED_PRECONDITION),
    the process lives, and one timeout period later the same communicator works again with no
    reset().  (jaxlib 0.12 does not starve: everything succeeds.)"""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PJRT_NPROC="8", JAXK3_GATHER_TIMEOUT_S="2",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {CHILD_XLA_FLAGS}")  # the tests' level (conftest)
    env.pop("NPROC", None)
    r = subprocess.run([sys.executable, "-c", _STARVED], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LATER_OK True" in r.stdout, r.stdout + r.stderr[-3000:]
    failed = int(r.stdout.split("FAILED ")[1].split()[0])
    if failed:
        assert "DEADLINE_EXCEEDED" in r.stdout and set(r.stdout.split("[")[1].split("]")[0].replace("'", "").split(", ")) <= {
            "DEADLINE_EXCEEDED", "FAILED_PRECONDITION"}, r.stdout
