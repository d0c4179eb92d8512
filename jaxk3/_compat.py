"""Small compatibility layer over the JAX versions jaxk3 supports (0.10.2 through 0.12), and the
one place that reaches into ``jax._src``.

- `shard_map` lives at `jax.shard_map` (newer) or `jax.experimental.shard_map.shard_map`
  (older), and its replication-check switch is called `check_vma` (newer) or `check_rep`
  (older).
- The manual axes a value varies over: `jax.typeof(x).mat.varying` (0.10+) or `.vma` (older).
- `lax.pcast(x, names, to="varying")` (0.10+) or `lax.pvary(x, names)` (older).
- The identity of the trace being built, and the concrete mesh set with `jax.set_mesh`, are
  only reachable through `jax._src`.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
from jax import lax

try:  # jax >= 0.6 exports it at top level
    jax_shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as jax_shard_map  # type: ignore

_PARAMS = inspect.signature(jax_shard_map).parameters
CHECK_KW = "check_vma" if "check_vma" in _PARAMS else "check_rep"


def shard_map(f: Callable, mesh: jax.sharding.Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """`shard_map(f, mesh=..., in_specs=..., out_specs=...)` with the replication check off.

    Goes through `jaxk3.collectives.shard_map` when it exists: that wrapper records the concrete
    mesh while `f` is traced, which the FFI gathers need to pick their device group.
    """
    from jaxk3 import collectives

    sm = getattr(collectives, "shard_map", None)
    if sm is None:
        return jax_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{CHECK_KW: False})
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{CHECK_KW: False})


def call_shard_map(f: Callable, **kwargs: Any) -> Callable:
    """`jax.shard_map(f, **kwargs)`, accepting either name of the replication-check switch."""
    for ours, theirs in (("check_vma", "check_rep"), ("check_rep", "check_vma")):
        if ours in kwargs and ours not in _PARAMS and theirs in _PARAMS:
            kwargs[theirs] = kwargs.pop(ours)
    return jax_shard_map(f, **kwargs)


def varying_axes(x) -> frozenset:
    """The manual axes `x` (an array or an aval) varies over."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def make_varying(x, names: tuple):
    """`x` typed as varying over `names` too (values unchanged)."""
    if hasattr(lax, "pcast"):
        return lax.pcast(x, names, to="varying")
    return lax.pvary(x, names)  # pragma: no cover - older jax


def trace_id() -> int | None:
    """Identity of the trace being built now (a nested jit, loop body or cond branch has its own)."""
    try:
        from jax._src import core

        return id(core.trace_ctx.trace)
    except Exception:  # a jax without trace_ctx: treated as "not the body's trace"
        return None


def mesh_in_context():
    """The concrete mesh set with `jax.set_mesh` / `jax.sharding.use_mesh`, or None."""
    try:
        from jax._src import mesh as mesh_lib

        m = mesh_lib.get_concrete_mesh()
        if m is not None and not m.empty:
            return m
    except Exception:
        pass
    return None
