"""The static decision: :func:`plan` applies the group-level and op-level rules (:mod:`rules`)
to one collective, identically on every device.  The wrappers plan when a collective is traced
(falling back to lax at once when the answer is already lax); the lowering rule plans again
with the devices known, and that decision is final.  :func:`explain` plans for an operand."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxk3.collectives import context, interface, rules, settings
from jaxk3.collectives.base import Plan


def axis_names(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def plan(shape: Sequence[int], dtype, axis_name, *, padded: bool = False, impl: str = "auto",
         mesh=None, op: str = "all_gather", where: context.Where | None = None) -> Plan:
    """Decides, statically, how a collective (`op`: ``all_gather`` or ``psum``) of an array of
    `shape`/`dtype` over `axis_name` runs.

    Call it where `axis_name` is bound (inside shard_map), or pass `mesh`.  Without a concrete
    mesh (a plain ``jax.shard_map``) the devices are resolved when the program is lowered, and
    the plan says so."""
    spec = rules.OPS[op]
    impl = settings.resolve_impl(impl)
    names = axis_names(axis_name)
    if not names:
        return Plan("identity", "empty axis name tuple")
    where = where or context.where_traced(mesh)
    n = rules.group_size(names, where.axes)
    if n == 1:
        return Plan("identity", f"the group has one device: the {spec.noun} is the identity")
    if impl == "lax":
        return Plan("lax", "impl='lax' asked for", group_size=n)

    def no(reason: str) -> Plan:
        return Plan("lax", reason, group_size=n)

    if (why := rules.operand_refusal(shape, dtype, spec)) is not None:
        return no(why)
    group = rules.resolve_group(names, where)
    if isinstance(group, str):
        return no(group)
    nbytes = rules.payload_bytes(shape, dtype)
    for rule in (lambda: rules.platform_refusal(spec, group.platform),
                 lambda: rules.bytes_refusal(nbytes, group.platform),
                 lambda: rules.activate_group(group)):  # in order: activating loads and creates things
        if (why := rule()) is not None:
            return no(why)
    target, reason = rules.layout(spec, nbytes, padded)
    if group.table is None:
        return Plan("ffi", reason + "; the devices are resolved when the program is lowered" +
                    rules.multi_process_note(), target=target, group_size=n, platform=group.platform)
    return Plan("ffi", reason, target=target, group_size=n, platform=group.platform,
                table=group.table.table, groups=group.table.groups)


def canonical_axis(axis: int, ndim: int, tiled: bool) -> int:
    limit = ndim if tiled else ndim + 1
    if not -limit <= axis < limit:
        raise ValueError(f"axis {axis} is out of range for an array of rank {ndim} (tiled={tiled})")
    return axis % limit


def explain(x, axis_name, *, axis: int = 0, tiled: bool = False, impl: str = "auto", padded: bool = False,
            mesh=None, op: str = "all_gather", axis_index_groups=None, to: str = "varying") -> Plan:
    """Which path a collective of `x` over `axis_name` takes, and why (a :class:`Plan`).

    `op` is ``all_gather`` (the default; `axis`, `tiled`, `padded`, `to` apply) or ``psum``.
    Call it where the collective would be traced (inside shard_map), or pass `mesh`."""
    x = jax.ShapeDtypeStruct(np.shape(x), x.dtype) if not hasattr(x, "shape") else x
    if op == "all_gather":
        canonical_axis(axis, len(x.shape), tiled)
    refusal = interface.refusal(op, x, axis_name, axis_index_groups=axis_index_groups, to=to, mesh=mesh,
                                unbound_to_lax=False)
    if refusal is not None:
        return refusal
    return plan(tuple(x.shape), x.dtype, axis_name, padded=padded, impl=impl, mesh=mesh, op=op)
