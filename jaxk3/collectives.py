"""One-shot all-gathers as XLA FFI custom calls, bitwise-equal to ``jax.lax.all_gather``.

Call these inside ``jax.shard_map`` (axis names bound).  Each call decides *statically*, at
trace time and identically on every device, whether it takes the FFI fast path or falls
back to ``lax.all_gather``; :func:`explain` reports that decision and its reason.  The rules
live in one function, :func:`plan`.

The FFI path needs to know the concrete devices of the mesh.  It finds them from
``jaxk3.shard_map`` (a drop-in wrapper of ``jax.shard_map`` that records the mesh while
tracing) or from a mesh set with ``jax.set_mesh`` / ``jax.sharding.use_mesh``.

Environment variables (read when a gather is traced, so they can change between traces):

=========================  ======================================================  ========
variable                   meaning                                                 default
=========================  ======================================================  ========
``JAXK3_GATHER``           default ``impl``: ``auto``, ``ffi`` or ``lax``          ``auto``
``JAXK3_GATHER_MAX_ROWS``  rows (all dims but the last) above which it falls back  ``64``
``JAXK3_GATHER_MAX_BYTES`` payload bytes per rank above which it falls back        CUDA ``1048576``, CPU ``32768``
``JAXK3_GATHER_TIMEOUT_S`` seconds a rank waits for its peers before failing       ``60``
=========================  ======================================================  ========
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ENV_IMPL = "JAXK3_GATHER"
ENV_MAX_ROWS = "JAXK3_GATHER_MAX_ROWS"
ENV_MAX_BYTES = "JAXK3_GATHER_MAX_BYTES"
ENV_TIMEOUT = "JAXK3_GATHER_TIMEOUT_S"

ONE_SHOT_TARGET = "jaxk3_one_shot_all_gather"
PADDED_TARGET = "jaxk3_padded_all_gather"
TRANSPORT_ALIGN = 16  # bytes; the padded variant pads each rank's payload to this

IMPLS = ("auto", "ffi", "lax")

# Dtypes the gathers move as plain bytes.  Sub-byte and exotic types fall back.
SUPPORTED_DTYPES = frozenset(
    np.dtype(d)
    for d in (
        np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
        np.uint64, np.float16, jnp.bfloat16, np.float32, np.float64,
    )
)

# jax platform name -> the platform name FFI targets are registered under.
_FFI_PLATFORM = {"cpu": "cpu", "gpu": "CUDA", "cuda": "CUDA"}


class GatherUnavailableError(RuntimeError):
    """``impl="ffi"`` was asked for but the fast path does not apply; the message says why."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static decision for one gather: ``path`` is ``ffi``, ``lax`` or ``identity``."""

    path: str
    reason: str
    target: str | None = None
    group_size: int = 1
    platform: str | None = None
    table: tuple[int, ...] = ()
    groups: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = f" via {self.target} on {self.platform}" if self.path == "ffi" else ""
        return f"{self.path}{where}: {self.reason}"


# ---------------------------------------------------------------------------------------
# The extension: imported and registered once, with one warning if it cannot be.
# ---------------------------------------------------------------------------------------

_lock = threading.Lock()
_ext: Any = None
_ext_error: str | None = None
_registered: set[str] = set()
_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _timeout_from_env() -> float | None:
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} must be a positive number of seconds")
    return seconds


def extension():
    """The compiled ``jaxk3._ffi`` module, or None (with the reason in ``extension_error()``)."""
    global _ext, _ext_error
    with _lock:
        if _ext is None and _ext_error is None:
            timeout = _timeout_from_env()  # a bad value is the user's error, not a failed import
            try:
                from jaxk3 import _ffi  # type: ignore[attr-defined]

                _ffi.set_process_index(int(jax.process_index()))
                if timeout is not None:
                    _ffi.set_timeout_ms(int(timeout * 1000))
                _ext = _ffi
            except Exception as e:  # ImportError, or an ABI problem
                _ext_error = f"the jaxk3._ffi extension failed to import ({type(e).__name__}: {e})"
        return _ext


def extension_error() -> str | None:
    extension()
    return _ext_error


def _targets_for(platform: str) -> dict[str, Any]:
    ext = extension()
    if ext is None:
        return {}
    if platform == "cpu":
        return dict(ext.cpu_targets())
    if platform == "CUDA":
        return dict(ext.cuda_targets())
    return {}


def _register(platform: str) -> bool:
    """Registers the targets of `platform` once; False when there is no handler for it."""
    with _lock:
        if platform in _registered:
            return True
    targets = _targets_for(platform)
    if not targets:
        return False
    with _lock:
        if platform not in _registered:
            for name, capsule in targets.items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
            _registered.add(platform)
    return True


def set_timeout(seconds: float) -> None:
    """Sets how long a rank waits for its peers before the gather fails (all communicators)."""
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {seconds}")
    ext = extension()
    if ext is None:
        raise GatherUnavailableError(extension_error())
    ext.set_timeout_ms(int(seconds * 1000))


def reset() -> None:
    """Forgets every communicator (e.g. after a timeout broke one).  No gather may be in flight."""
    ext = extension()
    if ext is not None:
        ext.reset()


# ---------------------------------------------------------------------------------------
# The mesh in context.
# ---------------------------------------------------------------------------------------

_mesh_stack = threading.local()


def _trace_id() -> int | None:
    """Identity of the trace being built now (a nested jit, loop body or cond branch has its own)."""
    try:
        from jax._src import core

        return id(core.trace_ctx.trace)
    except Exception:  # a jax without trace_ctx: treated as "not the body's trace"
        return None


@contextlib.contextmanager
def _tracing_mesh(mesh, trace_id):
    stack = getattr(_mesh_stack, "meshes", None)
    if stack is None:
        stack = _mesh_stack.meshes = []
    stack.append((mesh, trace_id))
    try:
        yield
    finally:
        stack.pop()


def shard_map(f, *, mesh, in_specs, out_specs, **kwargs):
    """``jax.shard_map`` that lets the gathers inside ``f`` see the concrete mesh."""

    @functools.wraps(f)
    def traced(*args):
        with _tracing_mesh(mesh, _trace_id()):
            return f(*args)

    return _jax_shard_map(traced, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs)


def _jax_shard_map(f, **kwargs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, **kwargs)
    from jax.experimental.shard_map import shard_map as legacy  # pragma: no cover

    if "check_vma" in kwargs:
        kwargs["check_rep"] = kwargs.pop("check_vma")
    return legacy(f, **kwargs)


def _in_body_trace() -> bool:
    """True when the gather is traced directly in a jaxk3.shard_map body, not in a nested
    jax.jit (whose cached trace may be inlined several times), a loop body or a cond branch."""
    stack = getattr(_mesh_stack, "meshes", None)
    return bool(stack) and stack[-1][1] is not None and stack[-1][1] == _trace_id()


def _current_mesh():
    stack = getattr(_mesh_stack, "meshes", None)
    if stack:
        return stack[-1][0]
    try:
        from jax._src import mesh as mesh_lib

        m = mesh_lib.get_concrete_mesh()
        if m is not None and not m.empty:
            return m
    except Exception:
        pass
    return None


def _abstract_axes() -> tuple[dict[str, int], dict[str, str]]:
    """Sizes and types of the axes bound where the gather is traced."""
    am = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(am.axis_names, am.axis_sizes))
    types = {n: str(t) for n, t in zip(am.axis_names, am.axis_types)}
    return sizes, types


# ---------------------------------------------------------------------------------------
# The rules.
# ---------------------------------------------------------------------------------------

def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def default_impl() -> str:
    impl = os.environ.get(ENV_IMPL, "auto").strip().lower() or "auto"
    if impl not in IMPLS:
        raise ValueError(f"{ENV_IMPL}={impl!r}: expected one of {IMPLS}")
    return impl


def max_rows() -> int:
    return _env_int(ENV_MAX_ROWS, 64)


# Above this many bytes per rank the CPU handler (one thread copies all n x n payloads) loses
# to XLA's all-gather at 8 devices (docs/PERF.md: 16 KB 5x faster, 64 KB 0.83x).
_DEFAULT_MAX_BYTES = {"cpu": 32 << 10, "CUDA": 1 << 20}


def max_bytes(platform: str = "CUDA") -> int:
    return _env_int(ENV_MAX_BYTES, _DEFAULT_MAX_BYTES.get(platform, 1 << 20))


def _axis_names(axis_name) -> tuple[str, ...]:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _ffi_ordinal(d) -> int:
    """The number XLA's FFI reports as this device's ordinal (`Ctx<DeviceOrdinal>`).

    On CPU it is the global device id (seen: 2048.. in process 1 of a 2-process run, where
    local_hardware_id is 0..); on CUDA it is the process-local GPU ordinal."""
    if d.platform == "cpu" or d.local_hardware_id is None:
        return int(d.id)
    return int(d.local_hardware_id)


def _group_tables(mesh, names: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(table, groups, spans_processes) for gathering over `names` of `mesh`.

    A group is the set of devices that share every coordinate outside `names`; a device's
    rank is its coordinate along `names`, row-major in the order given (as lax numbers it).
    """
    axis_order = list(mesh.axis_names)
    devices = np.asarray(mesh.devices)
    gather_axes = [axis_order.index(n) for n in names]
    other_axes = [i for i in range(devices.ndim) if i not in gather_axes]
    # Put the other axes first, then the gather axes in the order asked: rows are groups.
    arranged = np.transpose(devices, other_axes + gather_axes)
    n = int(np.prod([devices.shape[i] for i in gather_axes]))
    grouped = arranged.reshape(-1, n)
    table: list[int] = []
    groups: list[int] = []
    spans = False
    for g, row in enumerate(grouped):
        procs = {d.process_index for d in row}
        spans |= len(procs) > 1
        groups.extend(int(d.id) for d in row)
        for r, d in enumerate(row):
            table.extend((int(d.process_index), _ffi_ordinal(d), g, r))
    return tuple(table), tuple(groups), spans


def plan(shape: Sequence[int], dtype, axis_name, *, padded: bool = False, impl: str = "auto",
         mesh=None) -> Plan:
    """Decides, statically, how a gather of an array of `shape`/`dtype` over `axis_name` runs.

    This is the only place the fallback rules live.  Must be called where `axis_name` is
    bound (inside shard_map), unless `mesh` is given.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    names = _axis_names(axis_name)
    if not names:
        return Plan("identity", "empty axis name tuple")

    if mesh is not None:
        sizes = dict(zip(mesh.axis_names, np.asarray(mesh.devices).shape))
        types = {n: "Manual" for n in mesh.axis_names}
    else:
        sizes, types = _abstract_axes()
    missing = [n for n in names if n not in sizes]
    if missing:
        raise NameError(f"unbound axis name(s) {missing}: call the gathers inside shard_map")
    n = int(np.prod([sizes[a] for a in names]))
    if n == 1:
        return Plan("identity", "the group has one device: the gather is the identity")
    if impl == "lax":
        return Plan("lax", "impl='lax' asked for", group_size=n)

    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) >= 2 else 1

    def no(reason: str) -> Plan:
        return Plan("lax", reason, group_size=n)

    if dt not in SUPPORTED_DTYPES:
        return no(f"dtype {dt.name} is not moved by the FFI gathers")
    if nbytes == 0:
        return no("empty payload")
    if rows > max_rows():
        return no(f"{rows} rows > {ENV_MAX_ROWS}={max_rows()} (prefill-sized)")
    not_manual = [a for a in sizes if "Manual" not in types.get(a, "Manual")]
    if not_manual:
        return no(f"mesh axes {not_manual} are not manual (partial shard_map)")
    m = mesh if mesh is not None else _current_mesh()
    if m is None:
        return no("the concrete mesh is unknown here: use jaxk3.shard_map or jax.set_mesh")
    if any(a not in m.axis_names for a in names):
        return no(f"axis {names} not in the mesh in context {tuple(m.axis_names)}")
    platform = _FFI_PLATFORM.get(np.asarray(m.devices).flat[0].platform)
    if platform is None:
        return no(f"no jaxk3 handler for platform {np.asarray(m.devices).flat[0].platform!r}")
    if nbytes > max_bytes(platform):
        return no(f"{nbytes} bytes per rank > {ENV_MAX_BYTES}={max_bytes(platform)} (the {platform} default"
                  " is where the FFI path stops beating lax)")
    if platform == "cpu" and mesh is None and not _in_body_trace():
        # The CPU transport matches calls by call site and per-device generation.  A nested
        # jax.jit's trace is cached and inlined once per call (one site, several instances), and
        # XLA's CPU runtime may run independent instances in a different order per device.
        return no("on CPU the FFI gather must be traced directly in a jaxk3.shard_map body "
                  "(not in a nested jax.jit, loop body or cond branch, whose call sites may repeat)")
    table, groups, spans = _group_tables(m, names)
    if spans:
        return no("the group spans processes (XLA's collectives handle that)")
    if extension() is None:
        _warn_once("ext", f"jaxk3 gathers fall back to lax.all_gather: {extension_error()}")
        return no(extension_error() or "extension unavailable")
    if not _register(platform):
        _warn_once(platform, f"jaxk3 was built without {platform} handlers; gathers fall back to lax.all_gather")
        return no(f"this jaxk3 build has no {platform} handler")
    if platform == "CUDA":
        ok, why = _cuda_group_ok(groups, n)
        if not ok:
            return no(why)
    unaligned = nbytes % TRANSPORT_ALIGN != 0
    target = PADDED_TARGET if (padded or unaligned) else ONE_SHOT_TARGET
    reason = "eligible"
    if unaligned and not padded:
        reason = f"eligible; {nbytes} bytes per rank is not a multiple of {TRANSPORT_ALIGN}, so the padded transport"
    return Plan("ffi", reason, target=target, group_size=n, platform=platform, table=table, groups=groups)


def _cuda_group_ok(groups: tuple[int, ...], n: int) -> tuple[bool, str]:
    ext = extension()
    check = getattr(ext, "cuda_group_ok", None)
    if check is None:
        return False, "no CUDA peer-access check in this build"
    for i in range(0, len(groups), n):
        ok, why = check(list(groups[i:i + n]))
        if not ok:
            return False, why
    return True, ""


# ---------------------------------------------------------------------------------------
# The gathers.
# ---------------------------------------------------------------------------------------

_site_ids = itertools.count(1)


def _ffi_gather(x: jax.Array, p: Plan) -> jax.Array:
    """Rank-major gather: returns [n, *x.shape], row r = rank r's x."""
    out = jax.ShapeDtypeStruct((p.group_size, *x.shape), x.dtype)
    call = jax.ffi.ffi_call(p.target, out)
    return call(
        x,
        site=np.int64(next(_site_ids)),
        group_size=np.int64(p.group_size),
        table=np.asarray(p.table, dtype=np.int64),
        groups=np.asarray(p.groups, dtype=np.int64),
    )


def _arrange(stacked: jax.Array, ndim: int, axis: int, tiled: bool) -> jax.Array:
    """[n, *shape] rank-major -> lax.all_gather's layout for (axis, tiled)."""
    moved = jnp.moveaxis(stacked, 0, axis)
    if not tiled:
        return moved
    shape = list(moved.shape)
    shape[axis:axis + 2] = [shape[axis] * shape[axis + 1]]
    return moved.reshape(shape)


def _canonical_axis(axis: int, ndim: int, tiled: bool) -> int:
    limit = ndim if tiled else ndim + 1
    if not -limit <= axis < limit:
        raise ValueError(f"axis {axis} is out of range for an array of rank {ndim} (tiled={tiled})")
    return axis % limit


def _gather_leaf(x, axis_name, axis: int, tiled: bool, impl: str, padded: bool):
    x = jnp.asarray(x)
    if tiled and x.ndim == 0:
        raise ValueError("tiled all_gather needs an array of rank >= 1")
    a = _canonical_axis(axis, x.ndim, tiled)
    p = plan(x.shape, x.dtype, axis_name, padded=padded, impl=impl)
    if p.path == "identity":
        return x if tiled else jnp.expand_dims(x, a)
    if p.path == "lax":
        if impl == "ffi":
            raise GatherUnavailableError(f"impl='ffi' but the FFI gather does not apply: {p.reason}")
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
    y = _ffi_gather(x, p)
    # Type it as lax.all_gather's result: varying over the gathered axes (and whatever x varied
    # over); the custom call's output carries no such type by itself.
    missing = tuple(n for n in (*_axis_names(axis_name), *sorted(_varying(x))) if n not in _varying(y))
    if missing:
        y = _make_varying(y, tuple(dict.fromkeys(missing)))
    return _arrange(y, x.ndim, a, tiled)


def _varying(x) -> frozenset:
    """The manual axes `x` varies over (jax >= 0.10: `typeof(x).manual_axis_type.varying`)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(jax.typeof(x), "vma", ()))


def _make_varying(x, names: tuple[str, ...]):
    if hasattr(lax, "pcast"):
        return lax.pcast(x, names, to="varying")
    return lax.pvary(x, names)


def _resolve(impl: str) -> str:
    """``auto`` defers to the JAXK3_GATHER environment variable; ``ffi``/``lax`` are explicit."""
    return default_impl() if impl == "auto" else impl


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False, impl: str = "auto"):
    """``lax.all_gather(x, axis_name, axis=axis, tiled=tiled)``, bitwise, through the one-shot FFI
    gather where eligible.  Accepts a pytree, a single axis name or a tuple of names."""
    impl = _resolve(impl)
    return jax.tree_util.tree_map(lambda leaf: _gather_leaf(leaf, axis_name, axis, tiled, impl, False), x)


def padded_all_gather(x, axis_name, *, axis: int = -1, tiled: bool = True, impl: str = "auto"):
    """Like :func:`all_gather` (same result), always with the padded transport: each rank's row is
    padded to 16 bytes in flight and stripped on arrival.  For one-row projection outputs whose
    width per rank (e.g. 131 or 264 bf16 columns) is not a multiple of 16 bytes."""
    impl = _resolve(impl)
    return jax.tree_util.tree_map(lambda leaf: _gather_leaf(leaf, axis_name, axis, tiled, impl, True), x)


def gather_logits(local_logits, axis_name, vocab_size: int, impl: str = "auto"):
    """Gathers vocab-parallel logits ``[..., V_pad/tp]`` into ``[..., vocab_size]``.

    Shards are concatenated along the last axis in rank order, then the padding is sliced off.
    Works for any number of leading rows (T > 1 falls back to lax when prefill-sized)."""
    local_logits = jnp.asarray(local_logits)
    if local_logits.ndim < 1:
        raise ValueError("gather_logits needs logits of rank >= 1 ([..., V_pad/tp])")
    full = padded_all_gather(local_logits, axis_name, axis=-1, tiled=True, impl=impl)
    if vocab_size > full.shape[-1]:
        raise ValueError(f"vocab_size {vocab_size} > gathered vocab {full.shape[-1]}")
    return full[..., :vocab_size]


def explain(x, axis_name, *, axis: int = 0, tiled: bool = False, impl: str = "auto", padded: bool = False,
            mesh=None) -> Plan:
    """Which path a gather of `x` over `axis_name` takes, and why (a :class:`Plan`).

    Call it where the gather would be traced (inside shard_map), or pass `mesh`."""
    impl = _resolve(impl)
    x = jax.ShapeDtypeStruct(np.shape(x), x.dtype) if not hasattr(x, "shape") else x
    _canonical_axis(axis, len(x.shape), tiled)
    return plan(tuple(x.shape), x.dtype, axis_name, padded=padded, impl=impl, mesh=mesh)
