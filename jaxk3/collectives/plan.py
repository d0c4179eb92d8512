"""The static decision: :func:`plan` applies the group-level and op-level rules (:mod:`rules`)
to one collective, identically on every device; :func:`explain` is the same for an operand."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxk3.collectives import rules, settings
from jaxk3.collectives.base import Plan
from jaxk3.collectives.context import Axes


def axis_names(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def plan(shape: Sequence[int], dtype, axis_name, *, padded: bool = False, impl: str = "auto",
         mesh=None) -> Plan:
    """Decides, statically, how a gather of an array of `shape`/`dtype` over `axis_name` runs.

    Must be called where `axis_name` is bound (inside shard_map), unless `mesh` is given."""
    impl = settings.resolve_impl(impl)
    names = axis_names(axis_name)
    if not names:
        return Plan("identity", "empty axis name tuple")
    axes = Axes.of_mesh(mesh) if mesh is not None else Axes.here()
    n = rules.group_size(names, axes)
    if n == 1:
        return Plan("identity", "the group has one device: the gather is the identity")
    if impl == "lax":
        return Plan("lax", "impl='lax' asked for", group_size=n)

    def no(reason: str) -> Plan:
        return Plan("lax", reason, group_size=n)

    if (why := rules.operand_refusal(shape, dtype)) is not None:
        return no(why)
    group = rules.resolve_group(names, axes, mesh, mesh_given=mesh is not None)
    if isinstance(group, str):
        return no(group)
    nbytes = rules.payload_bytes(shape, dtype)
    if (why := rules.bytes_refusal(nbytes, group.platform)) is not None:
        return no(why)
    if (why := rules.activate_group(group)) is not None:
        return no(why)
    target, reason = rules.gather_layout(nbytes, padded)
    return Plan("ffi", reason, target=target, group_size=n, platform=group.platform,
                table=group.table.table, groups=group.table.groups)


def canonical_axis(axis: int, ndim: int, tiled: bool) -> int:
    limit = ndim if tiled else ndim + 1
    if not -limit <= axis < limit:
        raise ValueError(f"axis {axis} is out of range for an array of rank {ndim} (tiled={tiled})")
    return axis % limit


def explain(x, axis_name, *, axis: int = 0, tiled: bool = False, impl: str = "auto", padded: bool = False,
            mesh=None) -> Plan:
    """Which path a gather of `x` over `axis_name` takes, and why (a :class:`Plan`).

    Call it where the gather would be traced (inside shard_map), or pass `mesh`."""
    x = jax.ShapeDtypeStruct(np.shape(x), x.dtype) if not hasattr(x, "shape") else x
    canonical_axis(axis, len(x.shape), tiled)
    return plan(tuple(x.shape), x.dtype, axis_name, padded=padded, impl=impl, mesh=mesh)
