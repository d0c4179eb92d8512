"""Where a collective is traced: the mesh axes bound there and, when known, the concrete mesh.

``jaxk3.collectives.shard_map`` records the concrete mesh while its body is traced; otherwise a
mesh set with ``jax.set_mesh`` is used.  Inside a plain ``jax.shard_map`` only the abstract mesh
(axis names, sizes and types) is visible.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass

import jax
import numpy as np

from jaxk3 import _compat

_local = threading.local()


@dataclass(frozen=True)
class Axes:
    """The axes bound where a collective is traced (or those of an explicit mesh)."""

    sizes: dict
    types: dict  # name -> "Manual", "Auto", "Explicit"

    @staticmethod
    def of_mesh(mesh) -> "Axes":
        sizes = dict(zip(mesh.axis_names, np.asarray(mesh.devices).shape))
        return Axes(sizes, {n: "Manual" for n in mesh.axis_names})

    @staticmethod
    def here() -> "Axes":
        am = jax.sharding.get_abstract_mesh()
        return Axes(dict(zip(am.axis_names, am.axis_sizes)),
                    {n: str(t) for n, t in zip(am.axis_names, am.axis_types)})

    def not_manual(self) -> list:
        return [a for a in self.sizes if "Manual" not in self.types.get(a, "Manual")]


def _stack() -> list:
    stack = getattr(_local, "meshes", None)
    if stack is None:
        stack = _local.meshes = []
    return stack


@contextlib.contextmanager
def tracing_mesh(mesh):
    """Marks `mesh` as the concrete mesh of the body traced inside this block."""
    stack = _stack()
    stack.append((mesh, _compat.trace_id()))
    try:
        yield
    finally:
        stack.pop()


def shard_map(f, *, mesh, in_specs, out_specs, **kwargs):
    """``jax.shard_map`` that lets the collectives inside ``f`` see the concrete mesh."""

    @functools.wraps(f)
    def traced(*args):
        with tracing_mesh(mesh):
            return f(*args)

    return _compat.call_shard_map(traced, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs)


def in_body_trace() -> bool:
    """True when traced directly in a jaxk3.shard_map body, not in a nested jax.jit (whose cached
    trace may be inlined several times), a loop body or a cond branch."""
    stack = _stack()
    return bool(stack) and stack[-1][1] is not None and stack[-1][1] == _compat.trace_id()


def current_mesh():
    """The concrete mesh where the collective is traced, or None."""
    stack = _stack()
    if stack:
        return stack[-1][0]
    return _compat.mesh_in_context()
