"""Test session set-up: 8 fake CPU devices, set before JAX initialises its backend."""
import os
import re

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _cuda_plugin_installed() -> bool:
    """A CUDA PJRT plugin, as a wheel (jax_cuda13_plugin, jax_cuda12_plugin) or only as jax's plugin namespace
    (jax_plugins.xla_cuda13 / xla_cuda12)."""
    import importlib.util

    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ImportError:  # jax_plugins absent: find_spec of its submodule imports it
            return False

    return any(found(m) for m in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
                                  "jax_plugins.xla_cuda12"))


# XLA's CPU backend at LLVM's -O0 (TEST_XLA_OPT_LEVEL) for the tests' programs and the processes they start: the
# suites' CPU is mostly XLA compiling the tiny models (a warm compile cache took test_model + test_generation from 545
# to 113 CPU-seconds), and LLVM's optimisation and code generation are half of each compile (perf, 2026-12-07).  -O0
# took a K3 numpy-reference test and a prefill-vs-loop test from 43-51 to 28-34 CPU-seconds (interleaved runs, the
# 2-core machine).  The tests compare paths compiled alike, or against references with tolerances; what LLVM's
# vectoriser changes is the order of reduction adds.  So the tests whose claims are bits recorded or compared at XLA's
# default level compile those programs with XLA_DEFAULT_OPTIONS (jit's compiler options): test_golden (its digests,
# through the model's `compiler_options`) and test_layers' same-bits test of the AttnRes stack's two forms.
# test_collectives_dropin's FFI-vs-lax gradients allow ~40 ulps of the largest (its comment says why).  Not on a
# machine with JAX_PLATFORMS other than cpu or a CUDA plugin installed (the GPU tests, the deviceless compile for the
# H200: what they compile is the device's), and not when XLA_FLAGS names a level already.  JAXK3_TEST_XLA_OPT=default
# keeps XLA's level everywhere.
TEST_XLA_OPT_LEVEL, XLA_DEFAULT_OPT_LEVEL = 0, 3
XLA_DEFAULT_OPTIONS = {"xla_backend_optimization_level": XLA_DEFAULT_OPT_LEVEL}
if (os.environ.get("JAXK3_TEST_XLA_OPT", "0") != "default" and "xla_backend_optimization_level" not in _flags
        and os.environ["JAX_PLATFORMS"] == "cpu" and not _cuda_plugin_installed()):
    _flags += f" --xla_backend_optimization_level={TEST_XLA_OPT_LEVEL}"
os.environ["XLA_FLAGS"] = _flags
# The level's flag as this process has it (set above, or inherited: pytest-xdist's workers get the controller's
# XLA_FLAGS), for the processes a test starts with XLA_FLAGS of their own (their device count).
CHILD_XLA_FLAGS = " ".join(re.findall(r"--xla_backend_optimization_level=\S+", _flags))
# Tests must not wait a minute for a peer that will never come.
os.environ.setdefault("JAXK3_GATHER_TIMEOUT_S", "20")
# One on-disk compilation cache for the session and for the CLI processes its tests start (every jax
# process reads these variables): the tiny models' programs compile once per distinct program, not once
# per test (measured: a tiny K3 model's first generate 21.7 s cold, 4.0 s from the cache, same tokens).
# An executable from the cache is the one compiled from the same program, so bits do not change.
# JAXK3_TEST_COMPILE_CACHE=0 turns it off; a JAX_COMPILATION_CACHE_DIR already set is used as it is.
if os.environ.get("JAXK3_TEST_COMPILE_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="jaxk3-test-compile-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

# pytest-xdist's --dist loadfile hands out whole files.  By default it queues them by their number of tests
# (--loadscope-reorder), which put the heavy files with few tests (two-process runs, the quick start, the
# model tests) last: one worker ran alone at the end of the suite.  Heaviest first instead (longest
# processing time first): these files, by their seconds in the CI logs (out/ci/tests-*.log), then the
# rest in collection order.  A stale list costs minutes, never a result: each file's own order is kept.
_HEAVY_FIRST = ("test_model.py", "test_kernels.py", "test_distributed.py", "test_generation.py", "test_stress.py",
                "test_collectives.py", "test_quickstart.py", "test_serving.py", "test_prefill_chunks.py",
                "test_experts_packed.py", "test_bench.py", "test_bitwise_paths.py", "test_golden.py",
                "test_oracles.py", "test_cli_misuse.py", "test_layers.py", "test_psum.py", "test_cli.py",
                "test_checkpoint.py")


# JAXK3_TEST_SUBSET=first-param (CI's newest-jax suite, .ci/run): each parametrized test function runs its first case
# only, but in the modules below, which run every case.  A difference of jax versions (an API, a lowering, Pallas'
# interpret mode) shows in any case of a function; the sweeps over shapes, dtypes and sizes are the first suite's.
# The collectives' modules stay whole because lax's own collectives are their spec on each jax (bits per shape, group
# size and device order), as does test_golden (tokens and logit digests at every TP size: XLA's partitioner is the
# jax version's).  test_bitwise_paths (the model's logits through the FFI gathers against lax's, over a pairwise set
# of TP sizes and switches) runs its first case there: the gathers' own bits on that jax are test_collectives'.
# Measured in CI on 2026-12-06: 685 of the newest-jax suite's 2518 test-seconds were such cases, and
# test_bitwise_paths' other cases 79 CPU-seconds of its 1188.
_EVERY_CASE = ("test_collectives.py", "test_psum.py", "test_collectives_dropin.py", "test_golden.py")


def _first_cases_only(config, items) -> None:
    if os.environ.get("JAXK3_TEST_SUBSET", "") in ("", "all"):
        return
    if os.environ["JAXK3_TEST_SUBSET"] != "first-param":
        raise pytest.UsageError(f"JAXK3_TEST_SUBSET={os.environ['JAXK3_TEST_SUBSET']!r}: 'first-param' or 'all'")
    seen, keep, drop = set(), [], []
    for item in items:
        fn = (str(item.path), getattr(item, "originalname", item.name))
        if (getattr(item, "callspec", None) is None or os.path.basename(str(item.path)) in _EVERY_CASE
                or fn not in seen):
            keep.append(item)
            seen.add(fn)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(trylast=True)  # after `-m` has deselected its tests, so that the first case left is the one kept
def pytest_collection_modifyitems(config, items):
    _first_cases_only(config, items)
    rank = {name: i for i, name in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))  # stable: files keep their order


@pytest.fixture
def fresh_steps():
    """The model's compiled steps forgotten before and after a test that patches what a step is traced with (the
    kernel registry, the compiler options): kernels are chosen when a step is traced, and jaxk3.generation caches its
    jitted steps per (config, options, mesh), so a step traced by an earlier test would run without the patch (and a
    patched one would outlive the test)."""
    from jaxk3 import generation

    def clear():
        generation.build_prefill.cache_clear()
        generation.build_decode_loop.cache_clear()
        jax.clear_caches()
    clear()
    yield
    clear()


_here = [True]  # False in pytest-xdist's controller (its workers write the test log's lines)


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", None):  # xdist >= 3.6: the order above, not the count of tests
        config.option.loadscopereorder = False
    if "PYTEST_XDIST_WORKER" not in os.environ and getattr(config.option, "numprocesses", None):
        _here[0] = False


# JAXK3_TEST_LOG=PATH: one line per finished test (wall seconds; CPU seconds of the worker and of the processes it
# started and waited for; RSS MiB; id; outcome), written as it ends, so that a run that dies (a crash, a CI time limit)
# still says which tests took the time and where memory went.  CI's suites share two cores: the CPU seconds are what a
# test costs the run, the wall seconds include its waits for the other suites.
_test_log = os.environ.get("JAXK3_TEST_LOG")
if _test_log:
    import resource
    import time

    _t0 = {}

    def _cpu() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def pytest_runtest_logstart(nodeid, location):
        if _here[0]:
            _t0[nodeid] = (time.monotonic(), _cpu())
            with open(_test_log, "a") as fh:
                fh.write(f"start {nodeid}\n")

    _outcome = {}

    def pytest_runtest_logreport(report):
        if _here[0] and (report.when == "call" or report.outcome != "passed"):
            _outcome.setdefault(report.nodeid, report.outcome)

    def pytest_runtest_logfinish(nodeid, location):
        if not _here[0]:
            return
        rss = open("/proc/self/statm").read().split()[1]
        mib = int(rss) * resource.getpagesize() / 2**20
        wall, cpu = _t0.pop(nodeid, (time.monotonic(), _cpu()))
        with open(_test_log, "a") as fh:
            fh.write(f"{time.monotonic() - wall:8.2f} s {_cpu() - cpu:8.2f} cpu-s {mib:8.0f} MiB {nodeid} "
                     f"{_outcome.pop(nodeid, '?')}\n")
