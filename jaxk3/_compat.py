"""Small compatibility layer over the JAX versions jaxk3 supports (0.10.2 through 0.12), and the
one place that reaches into ``jax._src``.

- `shard_map` lives at `jax.shard_map` (newer) or `jax.experimental.shard_map.shard_map`
  (older), and its replication-check switch is called `check_vma` (newer) or `check_rep`
  (older).
- The manual axes a value varies over: `jax.typeof(x).mat.varying` (0.10+) or `.vma` (older).
- `lax.pcast(x, names, to="varying")` (0.10+) or `lax.pvary(x, names)` (older).
- Whether the manual-axis types are being checked (shard_map's `check_vma`), the named-axis
  effects of a collective, the platform of the abstract mesh and the concrete mesh set with
  `jax.set_mesh` are only reachable through `jax._src` (or private attributes).
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

# lax's collectives as they are when jaxk3 is imported: the fallbacks call these, so that code
# which installs jaxk3's collectives in their place (jax.lax.psum = collectives.psum) still
# reaches lax's own.
lax_all_gather = lax.all_gather
lax_psum = lax.psum
lax_psum_scatter = lax.psum_scatter
CHECK_KW = "check_vma" if "check_vma" in _PARAMS else "check_rep"


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


def with_type(aval, *, shape=None, varying=None):
    """`aval` with another shape and/or set of varying manual axes."""
    kw = {}
    if shape is not None:
        kw["shape"] = tuple(shape)
    if varying is not None:
        mat = getattr(aval, "manual_axis_type", None)
        if mat is not None:
            kw["manual_axis_type"] = mat.update(varying=frozenset(varying))
        elif hasattr(aval, "vma"):  # pragma: no cover - older jax
            kw["vma"] = frozenset(varying)
    return aval.update(**kw) if kw else aval


def vma_checked() -> bool:
    """Whether shard_map checks the manual-axis types here (`check_vma=True`)."""
    try:
        from jax._src import config

        return bool(config._check_vma.value)
    except Exception:  # pragma: no cover
        return False


def size_one_axes_dropped() -> bool:
    """Whether lax.psum drops mesh axes of size one from its axis names (a jax config)."""
    try:
        from jax._src import config

        return bool(config.remove_size_one_mesh_axis_from_type.value)
    except Exception:  # pragma: no cover
        return False


def auto_pcast() -> bool:
    """Whether lax's collectives cast an invariant operand to varying by themselves."""
    try:
        from jax._src import config

        return bool(config.auto_pcast.value)
    except Exception:  # pragma: no cover
        return True


def axis_bound(name) -> bool:
    """Whether `name` is bound here by anything (shard_map, vmap, pmap)."""
    try:
        lax.axis_size(name)
        return True
    except NameError:
        return False


def named_axis_effects(names) -> set:
    """The effects lax's collectives declare for the axis names they use."""
    try:
        from jax._src import core

        return {core.NamedAxisEffect(n) for n in names}
    except Exception:  # pragma: no cover
        return set()


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def abstract_mesh_platform() -> str | None:
    """The platform of the abstract mesh in context (what shard_map bodies see), or None."""
    am = jax.sharding.get_abstract_mesh()
    device = getattr(am, "abstract_device", None)
    return getattr(device, "platform", None)


def device_platform() -> str:
    """The platform of the devices the code being traced will run on: the abstract mesh's in context (a shard_map
    body, whose mesh may hold devices of another kind than this process's default: a step compiled for a GPU target on
    a host without one, `jaxk3 bench decode --census --target`), else the default device's."""
    return abstract_mesh_platform() or jax.devices()[0].platform


def lowering_mesh(ctx):
    """(mesh, manual axes) of the shard_map a lowering rule runs in, or (None, None).  The mesh
    is concrete when shard_map was given one (or one was set with jax.set_mesh)."""
    axis_context = ctx.module_context.axis_context
    mesh = getattr(axis_context, "mesh", None)
    manual = getattr(axis_context, "manual_axes", None)
    if mesh is None or manual is None:
        return None, None
    return mesh, frozenset(manual)


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
