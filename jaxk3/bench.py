"""`jaxk3 bench gather`: per-gather latency of the FFI path against lax.all_gather, same run.

Method (docs/COLLECTIVES.md, the gather benchmark): a chain of K dependent gathers unrolled in one
jit (each gather's output feeds the next gather's input), wall time of the whole program
divided by K, median over repeats.  Two floors run the same chain without communication:

``xla_floor``  the gather replaced by a local ``jnp.tile`` of the same output size.  XLA fuses
               that chain to almost nothing, so it is *not* the cost of a dependent step.
``ffi_floor``  the gather replaced by one FFI call (``jaxk3_local_tile``: n local copies into
               the gather's [n, *x.shape] output, one small kernel on CUDA) followed by the
               same re-layout and slice: one FFI call + the same slice kernel, no exchange.
               ffi / ffi_floor is what the exchange itself costs on top of being a separate op.
"""
from __future__ import annotations

import json
import os
import platform as _platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxk3 import collectives

DEFAULT_SIZES = (64, 256, 1024, 4096, 16384, 65536, 262144)


@dataclass
class GatherRow:
    bytes_per_rank: int
    impl: str
    path: str
    us_per_gather: float
    us_spread: tuple[float, float]  # min, max over repeats


def _chain_fn(mesh, n: int, cols: int, chain: int, impl: str, dtype):
    """Returns a jitted f(x[n, cols]) running `chain` dependent gathers of [1, cols] per rank."""

    def step(x, i):
        if impl == "xla_floor":
            g = jnp.tile(x, (1, n))
        elif impl == "ffi_floor":
            g = _local_tile(x, n)
        else:
            g = collectives.all_gather(x, "tp", axis=1, tiled=True, impl=impl)
        k = (i + 1) % n  # read a peer's slice, so the next step depends on the exchange
        return g[:, k * cols:(k + 1) * cols]

    def body(x):
        for i in range(chain):
            x = step(x, i)
        return x

    f = collectives.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    return jax.jit(f)


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
                 dtype=jnp.float32, impls=("xla_floor", "ffi_floor", "lax", "ffi"), progress=None) -> dict:
    # Measure the FFI path at every size asked, past the default cap that `auto` applies.
    saved = os.environ.get(collectives.ENV_MAX_BYTES)
    os.environ[collectives.ENV_MAX_BYTES] = str(max(sizes))
    try:
        return _bench_gather(sizes, chain, repeats, devices, dtype, impls, progress)
    finally:
        if saved is None:
            os.environ.pop(collectives.ENV_MAX_BYTES, None)
        else:
            os.environ[collectives.ENV_MAX_BYTES] = saved


def _bench_gather(sizes, chain, repeats, devices, dtype, impls, progress) -> dict:
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("tp",))
    itemsize = jnp.dtype(dtype).itemsize
    rows: list[GatherRow] = []
    for nbytes in sizes:
        cols = max(1, nbytes // itemsize)
        x = jax.device_put(
            jax.random.normal(jax.random.key(nbytes), (n, cols), jnp.float32).astype(dtype),
            NamedSharding(mesh, P("tp")),
        )
        refs: dict[str, tuple[str, np.ndarray]] = {}  # family -> (first impl, its result)
        for impl in impls:
            if progress:
                progress(f"{cols * itemsize} B/rank {impl}")
            fn = _chain_fn(mesh, n, cols, chain, impl, dtype)
            path = "local" if impl.endswith("floor") else _path_of(mesh, cols, dtype, impl)
            times = _time(fn, x, repeats)
            result = np.asarray(fn(x))
            # The gathers read a peer's slice, the floors their own: each family must agree bitwise.
            family = "floor" if impl.endswith("floor") else "gather"
            if family not in refs:
                refs[family] = (impl, result)
            elif not np.array_equal(result.view(np.uint8), refs[family][1].view(np.uint8)):
                raise AssertionError(f"{impl} chain differs from the {refs[family][0]} chain at {nbytes} B/rank")
            per = [t / chain * 1e6 for t in times]
            rows.append(GatherRow(cols * itemsize, impl, path, statistics.median(per), (min(per), max(per))))
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


def _path_of(mesh, cols, dtype, impl) -> str:
    p = collectives.explain(jax.ShapeDtypeStruct((1, cols), dtype), "tp", axis=1, tiled=True, impl=impl, mesh=mesh)
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
    """Sizes x {xla_floor, ffi_floor, lax, ffi} with the ratios lax/ffi and ffi/ffi_floor."""
    by = {}
    for r in result["rows"]:
        by.setdefault(r["bytes_per_rank"], {})[r["impl"]] = r
    head = (f"{'bytes/rank':>10} | {'xla_floor':>9} | {'ffi_floor':>9} | {'lax us':>9} | {'ffi us':>9} | "
            f"{'lax/ffi':>7} | {'ffi/ffi_floor':>13} | path")
    lines = [
        f"gather chain: {result['devices']} x {result['device_kind']} ({result['platform']}), "
        f"chain {result['chain']}, median of {result['repeats']}, {result['dtype']}, "
        f"jax {result['versions']['jax']}  (us per dependent step)",
        head,
        "-" * len(head),
    ]
    nan = float("nan")
    for b in sorted(by):
        d = by[b]
        us = {k: d.get(k, {}).get("us_per_gather", nan) for k in ("xla_floor", "ffi_floor", "lax", "ffi")}
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
