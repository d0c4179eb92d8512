"""`jaxk3 bench gather`: per-collective latency of the FFI path against lax, same run.

Method (docs/COLLECTIVES.md, the gather benchmark): a chain of K dependent collectives in one jit
(each one's output feeds the next one's input), wall time of the whole program divided by K,
median over repeats, under a plain ``jax.shard_map``.  Two ops, two forms:

``gather``     ``all_gather`` of [1, cols] per rank (tiled), then a peer's slice;
``allreduce``  ``psum`` of [1, cols] per rank, scaled by 1/n;
``unrolled``   the K steps unrolled in the program;
``scan``       the K steps as the body of one ``lax.scan`` (a decode loop on the device).

Two floors run the same chain without communication:

``xla_floor``  the collective replaced by a local op of the same output size (``jnp.tile``; for
               the all-reduce ``x * n``).  XLA fuses that chain to almost nothing, so it is
               *not* the cost of a dependent step.
``ffi_floor``  the collective replaced by one FFI call (``jaxk3_local_tile``: n local copies into
               the gather's [n, *x.shape] output, one for the all-reduce; one small kernel on
               CUDA) followed by the same re-layout and slice: one FFI call + the same slice
               kernel, no exchange.  ffi / ffi_floor is what the exchange itself costs on top
               of being a separate op.

``load``       N busy processes (pure CPU spinners, :func:`busy_load`) run beside the chains while
               they are compiled and timed: the figures of a machine that other work shares.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform as _platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxk3 import collectives

DEFAULT_SIZES = (64, 256, 1024, 4096, 16384, 65536, 262144)
IMPLS = ("xla_floor", "ffi_floor", "lax", "ffi")
OPS = ("gather", "allreduce")
FORMS = ("unrolled", "scan")


@dataclass
class GatherRow:
    bytes_per_rank: int
    impl: str
    path: str
    us_per_gather: float            # per dependent step (of either op)
    us_spread: tuple[float, float]  # min, max over repeats
    op: str = "gather"
    form: str = "unrolled"


def _step(op: str, impl: str, n: int, cols: int):
    """One dependent step of `op` on a [rows, cols] operand; `i` is the step index (traced in
    a scan)."""

    def gather(x, i):
        if impl == "xla_floor":
            g = jnp.tile(x, (1, n))
        elif impl == "ffi_floor":
            g = _local_tile(x, n)
        else:
            g = collectives.all_gather(x, "tp", axis=1, tiled=True, impl=impl)
        k = (i + 1) % n  # read a peer's slice, so the next step depends on the exchange
        return lax.dynamic_slice_in_dim(g, k * cols, cols, axis=1)

    def allreduce(x, i):
        if impl == "xla_floor":
            s = x * n
        elif impl == "ffi_floor":
            s = collectives.local_tile(x, 1, axis=0, tiled=True)
        else:
            s = collectives.psum(x, "tp", impl=impl)
        return s * jnp.asarray(1.0 / n, x.dtype)

    return gather if op == "gather" else allreduce


def _chain_fn(mesh, n: int, cols: int, chain: int, impl: str, dtype, op: str = "gather", form: str = "unrolled"):
    """Returns a jitted f(x[n, cols]) running `chain` dependent steps of `op` on [1, cols] per
    rank, unrolled or as a lax.scan body, under a plain jax.shard_map."""
    step = _step(op, impl, n, cols)

    def body(x):
        if form == "scan":
            x, _ = lax.scan(lambda c, i: (step(c, i), None), x, jnp.arange(chain))
            return x
        for i in range(chain):
            x = step(x, i)
        return x

    # the type check off: the floors' local ops are not typed as the collectives they stand for
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))


def _local_tile(x, n: int):
    """`jnp.tile(x, (1, n))` for a [rows, cols] x through one FFI call: the gather's output shape
    [n, rows, cols] from n local copies, then the gather's own re-layout (tiled along axis 1)."""
    return collectives.local_tile(x, n, axis=1, tiled=True)


def _time(fn, x, repeats: int) -> list[float]:
    jax.block_until_ready(fn(x))  # compile + warm up
    jax.block_until_ready(fn(x))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        out.append(time.perf_counter() - t0)
    return out


def bench_gather(sizes=DEFAULT_SIZES, chain: int = 100, repeats: int = 15, devices=None,
                 dtype=jnp.float32, impls=IMPLS, progress=None, ops=("gather",), forms=("unrolled",)) -> dict:
    """The gather chain (unrolled), as `jaxk3 bench gather` has always run it; `ops` and `forms`
    add the all-reduce and the scan body (see :func:`bench_collectives`)."""
    return bench_collectives(sizes, chain, repeats, devices, dtype, impls, progress, ops=ops, forms=forms)


# A busy process: pure CPU, no memory traffic.  Every 2**20 turns (about 0.1 s) it checks that
# the process that started it is still there, and leaves if not (that one was killed outright).
_SPINNER = ("import os, sys\nparent, i = int(sys.argv[1]), 1\n"
            "while i or os.getppid() == parent:\n    i = (i + 1) & 0xFFFFF")


@contextlib.contextmanager
def busy_load(n: int):
    """`n` busy processes beside the caller, started on entry, killed and reaped on exit (an error
    or Ctrl-C included); yields their pids.  They are this process's children, in its session (and
    so its scheduler autogroup): they compete with XLA's device threads thread for thread, as busy
    jobs started from the same shell do."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _SPINNER, str(os.getpid())],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def bench_collectives(sizes=DEFAULT_SIZES, chain: int = 100, repeats: int = 15, devices=None,
                      dtype=jnp.float32, impls=IMPLS, progress=None, ops=OPS, forms=FORMS, load: int = 0) -> dict:
    """Every op in every form at every size, {xla_floor, ffi_floor, lax, ffi} each, one run;
    `load` busy processes beside it throughout (:func:`busy_load`)."""
    # Measure the FFI path at every size asked, past the default cap that `auto` applies.
    saved = os.environ.get(collectives.ENV_MAX_BYTES)
    os.environ[collectives.ENV_MAX_BYTES] = str(max(sizes))
    try:
        with busy_load(load) as pids:
            result = _bench(sizes, chain, repeats, devices, dtype, impls, progress, ops, forms)
            waiters = _waiters()
        return {**result, "load": load, "load_pids": pids, "cpu_waiters": waiters}
    finally:
        if saved is None:
            os.environ.pop(collectives.ENV_MAX_BYTES, None)
        else:
            os.environ[collectives.ENV_MAX_BYTES] = saved


def _waiters() -> str | None:
    """How the CPU transport's waiting ranks wait now ("yielding", or "asleep" once it saw busy threads of other
    processes take the cores: ffi/yield_gauge.h); None without the extension."""
    ext = collectives.extension()
    if ext is None or not hasattr(ext, "waiters_sleeping"):
        return None
    return "asleep" if ext.waiters_sleeping() else "yielding"


def _agree(a: np.ndarray, b: np.ndarray, op: str) -> bool:
    """Gathers agree bitwise; sums bitwise too except float16, which XLA's CPU all-reduce
    accumulates in float16 (jaxk3 in float32): there, within float16 rounding of the chain."""
    if op == "allreduce" and a.dtype == np.float16:
        return bool(np.allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-2, atol=1e-3))
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _bench(sizes, chain, repeats, devices, dtype, impls, progress, ops, forms) -> dict:
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("tp",))
    itemsize = jnp.dtype(dtype).itemsize
    rows: list[GatherRow] = []
    for op in ops:
        for form in forms:
            for nbytes in sizes:
                cols = max(1, nbytes // itemsize)
                x = jax.device_put(
                    jax.random.normal(jax.random.key(nbytes), (n, cols), jnp.float32).astype(dtype),
                    NamedSharding(mesh, P("tp")),
                )
                refs: dict[str, tuple[str, np.ndarray]] = {}  # family -> (first impl, its result)
                for impl in impls:
                    if progress:
                        progress(f"{op} {form} {cols * itemsize} B/rank {impl}")
                    fn = _chain_fn(mesh, n, cols, chain, impl, dtype, op, form)
                    path = "local" if impl.endswith("floor") else _path_of(mesh, cols, dtype, impl, op)
                    times = _time(fn, x, repeats)
                    result = np.asarray(fn(x))
                    # The collectives and the floors compute different things: each family must agree.
                    family = "floor" if impl.endswith("floor") else "collective"
                    if family not in refs:
                        refs[family] = (impl, result)
                    elif not (family == "floor" and op == "allreduce") and not _agree(result, refs[family][1], op):
                        raise AssertionError(f"{op} {form}: {impl} chain differs from the {refs[family][0]} chain "
                                             f"at {nbytes} B/rank")
                    per = [t / chain * 1e6 for t in times]
                    rows.append(GatherRow(cols * itemsize, impl, path, statistics.median(per), (min(per), max(per)),
                                          op, form))
    return {
        "kind": "gather",
        "devices": n,
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "chain": chain,
        "repeats": repeats,
        "dtype": jnp.dtype(dtype).name,
        "versions": versions(),
        "rows": [asdict(r) for r in rows],
    }


def _path_of(mesh, cols, dtype, impl, op="gather") -> str:
    what = "psum" if op == "allreduce" else "all_gather"
    p = collectives.explain(jax.ShapeDtypeStruct((1, cols), dtype), "tp", axis=1, tiled=True, impl=impl, mesh=mesh,
                            op=what)
    return p.path if p.path != "ffi" else f"ffi:{p.target.replace('jaxk3_', '').replace('_all_gather', '')}"


def versions() -> dict:
    import jaxlib

    return {
        "jaxk3": __import__("jaxk3").__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": sys.version.split()[0],
        "machine": _platform.machine(),
        "cpus": os.cpu_count(),
    }


def gather_table(result: dict) -> str:
    """Per op and form: sizes x {xla_floor, ffi_floor, lax, ffi} with the ratios lax/ffi and
    ffi/ffi_floor."""
    groups: dict = {}
    for r in result["rows"]:  # old JSON files have no op/form (gather, unrolled)
        key = (r.get("op", "gather"), r.get("form", "unrolled"))
        groups.setdefault(key, {}).setdefault(r["bytes_per_rank"], {})[r["impl"]] = r
    head = (f"{'bytes/rank':>10} | {'xla_floor':>9} | {'ffi_floor':>9} | {'lax us':>9} | {'ffi us':>9} | "
            f"{'lax/ffi':>7} | {'ffi/ffi_floor':>13} | path")
    lines = [
        f"collective chains: {result['devices']} x {result['device_kind']} ({result['platform']}), "
        f"chain {result['chain']}, median of {result['repeats']}, {result['dtype']}, "
        f"jax {result['versions']['jax']}, load {result.get('load', 0)} busy processes"
        + (f", CPU waiters {result['cpu_waiters']} at the end" if result.get("cpu_waiters") and
           result.get("platform") == "cpu" else "") + "  (us per dependent step)",
    ]
    nan = float("nan")
    for (op, form), by in groups.items():
        lines += ["", f"{op}, {form}", head, "-" * len(head)]
        for b in sorted(by):
            d = by[b]
            us = {k: d.get(k, {}).get("us_per_gather", nan) for k in IMPLS}
            # old JSON files call the XLA floor "floor"
            if us["xla_floor"] != us["xla_floor"] and "floor" in d:
                us["xla_floor"] = d["floor"]["us_per_gather"]
            lines.append(f"{b:>10} | {us['xla_floor']:>9.1f} | {us['ffi_floor']:>9.1f} | {us['lax']:>9.1f} | "
                         f"{us['ffi']:>9.1f} | {us['lax'] / us['ffi']:>7.2f} | {us['ffi'] / us['ffi_floor']:>13.2f} | "
                         f"{d.get('ffi', {}).get('path', '-')}")
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
