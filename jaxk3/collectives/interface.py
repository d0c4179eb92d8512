"""The arguments and forms of lax's collectives that the FFI path does not serve, decided when a
collective is traced: those calls go to lax itself, with every argument, so that results, types
and errors are lax's.

- ``axis_index_groups`` (even ``None`` is accepted), ``all_gather(..., to=...)`` other than
  ``"varying"``;
- axis names bound by ``vmap(..., axis_name=)`` or ``pmap`` rather than by a shard_map mesh;
- ``psum``: positional (integer) axes, constant (non-traced) operands, and, under shard_map's
  type check, operands that are not varying over every named axis (lax casts or reduces those
  by its own rules).
"""
from __future__ import annotations

import jax

from jaxk3 import _compat
from jaxk3.collectives.base import Plan
from jaxk3.collectives.context import Axes


def names_of(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def refusal(op: str, x, axis_name, *, axis_index_groups=None, to: str = "varying", mesh=None,
            unbound_to_lax: bool = True) -> Plan | None:
    """A lax Plan when lax must serve this call for its form, else None (the rules decide).
    A name bound nowhere goes to lax too (which raises its own NameError) unless
    `unbound_to_lax` is False (explain: the plan raises it)."""

    def lax_(reason: str) -> Plan:
        return Plan("lax", reason)

    if axis_index_groups is not None:
        return lax_("axis_index_groups: served by lax")
    if op == "all_gather" and to != "varying":
        return lax_(f"to={to!r}: served by lax")
    names = names_of(axis_name)
    if op == "psum" and any(isinstance(n, int) for n in names):
        return lax_("positional (integer) axes: served by lax")
    if mesh is not None or not names:
        return None
    axes = Axes.here()
    not_manual = [n for n in names if not axes.manual((n,))]
    if any(n in axes.sizes for n in not_manual):
        return lax_(f"mesh axes {[n for n in not_manual if n in axes.sizes]} are not manual (partial shard_map)")
    elsewhere = [n for n in not_manual if _compat.axis_bound(n)]
    if elsewhere:
        return lax_(f"axis {elsewhere} is bound by vmap or pmap, not by a shard_map mesh: served by lax")
    if not_manual and unbound_to_lax:
        return lax_(f"unbound axis name(s) {not_manual}: lax's error")
    if op == "psum":
        if not _compat.is_tracer(x) and not isinstance(x, jax.ShapeDtypeStruct):
            return lax_("a constant operand: lax computes it without a collective")
        if _compat.is_tracer(x) and _compat.vma_checked():
            varying = _compat.varying_axes(x)
            if not set(names) <= varying:
                return lax_(f"the operand is not varying over {sorted(set(names) - varying)}: lax's rules apply")
    return None
