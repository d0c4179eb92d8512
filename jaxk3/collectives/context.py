"""Where a collective is traced or lowered: the axes bound there, the concrete mesh when known,
the platform; and the ``shard_map`` wrapper.

The device group of a collective is resolved when the program is lowered: the lowering
context of a ``jax.shard_map`` body knows the mesh (:func:`where_lowered`).  When traced, only
the abstract mesh (axis names, sizes, types, platform) is visible inside a plain
``jax.shard_map``; ``jaxk3.collectives.shard_map`` records the concrete mesh and ``jax.set_mesh``
sets one, so that :func:`explain` can name the devices already (:func:`where_traced`).
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
    """The mesh axes bound where a collective is traced or lowered."""

    sizes: dict
    types: dict  # name -> "Manual", "Auto", "Explicit"

    @staticmethod
    def of_mesh(mesh, manual=None) -> "Axes":
        names = tuple(mesh.axis_names)
        shape = getattr(mesh, "axis_sizes", None) or np.asarray(mesh.devices).shape
        sizes = dict(zip(names, (int(s) for s in shape)))
        return Axes(sizes, {n: "Manual" if manual is None or n in manual else "Auto" for n in names})

    @staticmethod
    def here() -> "Axes":
        am = jax.sharding.get_abstract_mesh()
        return Axes(dict(zip(am.axis_names, am.axis_sizes)),
                    {n: str(t) for n, t in zip(am.axis_names, am.axis_types)})

    def not_manual(self) -> list:
        return [a for a in self.sizes if "Manual" not in self.types.get(a, "Manual")]

    def manual(self, names) -> bool:
        """Whether every one of `names` is a manual (shard_map) axis here."""
        return all(n in self.sizes and "Manual" in self.types.get(n, "") for n in names)


@dataclass(frozen=True)
class Where:
    """Where a collective is planned."""

    axes: Axes
    mesh: object | None        # the concrete jax.sharding.Mesh, when known
    platform: str | None       # jax platform name ("cpu", "cuda", ...)
    lowering: bool             # at lowering: the final decision
    mesh_given: bool = False   # an explicit mesh= (explain/plan outside shard_map)


def platform_of(mesh) -> str:
    """The jax platform name of the mesh's devices."""
    return np.asarray(mesh.devices).flat[0].platform


def _stack() -> list:
    stack = getattr(_local, "meshes", None)
    if stack is None:
        stack = _local.meshes = []
    return stack


@contextlib.contextmanager
def tracing_mesh(mesh):
    """Marks `mesh` as the concrete mesh of the body traced inside this block."""
    stack = _stack()
    stack.append(mesh)
    try:
        yield
    finally:
        stack.pop()


def current_mesh():
    """The concrete mesh where the collective is traced, or None."""
    stack = _stack()
    if stack:
        return stack[-1]
    return _compat.mesh_in_context()


def where_traced(mesh=None) -> Where:
    """Where a collective traced now (or planned for an explicit `mesh`) runs, as far as known."""
    if mesh is not None:
        return Where(Axes.of_mesh(mesh), mesh, platform_of(mesh), lowering=False, mesh_given=True)
    axes = Axes.here()
    m = current_mesh()
    if m is not None and not all(a in m.axis_names for a in axes.sizes):
        m = None  # a mesh recorded or set outside that is not this shard_map's
    platform = platform_of(m) if m is not None else _compat.device_platform()
    return Where(axes, m, platform, lowering=False)


def where_lowered(ctx) -> Where | str:
    """Where a lowering rule runs, or why it is not a place the FFI path can serve."""
    mesh, manual = _compat.lowering_mesh(ctx)
    if mesh is None:
        return "lowered outside a shard_map body (pmap or a replica context)"
    platforms = tuple(ctx.module_context.platforms)
    if len(platforms) != 1:
        return f"lowered for several platforms at once {platforms}"
    concrete = mesh if isinstance(mesh, jax.sharding.Mesh) else None
    return Where(Axes.of_mesh(mesh, manual), concrete, platforms[0], lowering=True)


def shard_map(f=None, /, **kwargs):
    """``jax.shard_map`` with its full signature (decorator form, mesh from context, default
    in_specs where the jax version has them).  It also records a concrete mesh while ``f`` is
    traced, so that :func:`explain` inside ``f`` can name the devices; the collectives
    themselves resolve their devices when lowered and need no wrapper."""
    if f is None:
        return lambda g: shard_map(g, **kwargs)
    mesh = kwargs.get("mesh")
    if not isinstance(mesh, jax.sharding.Mesh):
        return _compat.call_shard_map(f, **kwargs)

    @functools.wraps(f)
    def traced(*args, **kw):
        with tracing_mesh(mesh):
            return f(*args, **kw)

    return _compat.call_shard_map(traced, **kwargs)
