"""``all_gather``: ``lax.all_gather``'s result, bitwise and with lax's type, through the one-shot
FFI gather where the plan allows it.

The FFI path is a primitive, ``jaxk3_all_gather``, typed like lax's all_gather; its lowering
(lowering.py) resolves the devices and emits the custom call, or lax's all-gather.  Its tangent
is the same gather, its transpose lax's (a reduce-scatter), and under vmap it gathers the
batched operand.

One form for both transports.  Every gather the FFI path could serve is computed as the rank-major
stack ``[n, *x.shape]`` (the custom call's output, or ``lax.all_gather(x, axis=0)`` when lax
serves it), then laid out by the same jnp ops (``layout.arrange``).  Gathering along another axis
directly lets XLA give lax's all-gather a layout of its choosing (on CPU, for a tiled gather along
the last axis: ``{0,1}``, column-major, the operand transposed before the exchange), while the
custom call's output is row-major and rank-major: the same values in two physical layouts, and
XLA's code for the ops that read them differs.  Reductions in them can round differently (XLA's
CPU emitter marks reduction adds ``reassoc`` and LLVM vectorises the sum by the loads' strides):
seen as float32 logits 1e-6..1e-5 apart at TP 2 between gather="ffi" and "lax" (issue 20; docs/
COLLECTIVES.md, traps).  A gather along axis 0 is already major-most, so XLA keeps lax's output
row-major, and both transports hand the consumers one buffer layout and one graph.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxk3 import _compat
from jaxk3.collectives import interface, settings
from jaxk3.collectives.base import GatherUnavailableError, Plan
from jaxk3.collectives.layout import arrange
from jaxk3.collectives.lowering import ffi_attributes, lower_collective
from jaxk3.collectives.planning import axis_names, canonical_axis, plan

all_gather_p = Primitive("jaxk3_all_gather")


def _abstract_eval(x, *, axis_name, axis, tiled, axis_size, padded, strict):
    shape = list(x.shape)
    if tiled:
        shape[axis] *= axis_size
    else:
        shape.insert(axis, axis_size)
    varying = _compat.varying_axes(x) if _compat.vma_checked() else frozenset()
    return _compat.with_type(x, shape=shape, varying=varying), _compat.named_axis_effects(axis_name)


def _emit(x, p: Plan, *, axis, tiled):
    stacked = jax.ffi.ffi_call(p.target, jax.ShapeDtypeStruct((p.group_size, *x.shape), x.dtype))(
        x, **ffi_attributes(p))
    return arrange(stacked, axis, tiled)


def _lower(ctx, x, *, axis_name, axis, tiled, axis_size, padded, strict):
    return lower_collective(
        ctx, x, op="all_gather", names=axis_name, padded=padded, strict=strict,
        emit=lambda v, p: _emit(v, p, axis=axis, tiled=tiled),
        fallback=lambda v: _compat.lax_all_gather(v, axis_name, axis=axis, tiled=tiled))


def _transpose(ct, x, *, axis_name, axis, tiled, **_):
    return [_compat.lax_psum_scatter(ct, axis_name, scatter_dimension=axis, tiled=tiled)]


def _batch(vals, dims, *, axis, tiled, **params):
    (x,), (d,) = vals, dims
    if d is None:  # not batched
        return all_gather_p.bind(x, axis=axis, tiled=tiled, **params), d
    if d <= axis:
        axis += 1
    elif not tiled:
        d += 1
    return all_gather_p.bind(x, axis=axis, tiled=tiled, **params), d


all_gather_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(all_gather_p, _lower, cacheable=False)
ad.deflinear2(all_gather_p, _transpose)
batching.primitive_batchers[all_gather_p] = _batch


def gather_leaf(x, axis_name, *, axis: int, tiled: bool, impl: str, padded: bool,
                axis_index_groups=None, to: str = "varying"):
    """One array's gather (impl already resolved): lax's, or the FFI primitive."""
    extra = {"to": to} if to != "varying" else {}

    def strict(p: Plan) -> None:
        if impl == "ffi" and p.path == "lax":
            raise GatherUnavailableError(f"impl='ffi' but the FFI gather does not apply: {p.reason}")

    def by_lax(p: Plan):
        """lax with every argument: the forms the FFI path does not serve, and a group of one."""
        strict(p)
        return _compat.lax_all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled, **extra)

    refused = interface.refusal("all_gather", x, axis_name, axis_index_groups=axis_index_groups, to=to)
    if refused is not None:
        return by_lax(refused)
    x = jnp.asarray(x)
    if tiled and x.ndim == 0:
        return by_lax(Plan("lax", "tiled gather of a scalar: lax's error"))
    a = canonical_axis(axis, x.ndim, tiled)
    p = plan(x.shape, x.dtype, axis_name, padded=padded, impl=impl)
    if p.path == "identity":
        return by_lax(p)  # lax's result and type for a group of one
    if p.path == "lax":  # a form the FFI path serves, through lax: the same rank-major form (module doc)
        strict(p)
        return arrange(_compat.lax_all_gather(x, axis_name, axis=0, tiled=False), a, bool(tiled))
    names = axis_names(axis_name)
    if _compat.vma_checked():
        missing = tuple(n for n in names if n not in _compat.varying_axes(x))
        if missing and not _compat.auto_pcast():
            return by_lax(Plan("lax", "operand not varying and auto_pcast off: lax's error"))
        if missing:
            x = _compat.make_varying(x, missing)  # as lax's all_gather casts it
    stacked = all_gather_p.bind(x, axis_name=names, axis=0, tiled=False, axis_size=p.group_size,
                                padded=bool(padded), strict=impl == "ffi")
    return arrange(stacked, a, bool(tiled))


def all_gather(x, axis_name, *, axis_index_groups=None, axis: int = 0, tiled: bool = False,
               to: str = "varying", impl: str = "auto"):
    """``_compat.lax_all_gather(x, axis_name, axis_index_groups=..., axis=..., tiled=..., to=...)``,
    bitwise and with lax's type, through the one-shot FFI gather where eligible.  Accepts a
    pytree, a single axis name or a tuple of names; a form the FFI path does not serve goes to
    lax with every argument."""
    impl = settings.resolve_impl(impl)
    return jax.tree_util.tree_map(
        lambda leaf: gather_leaf(leaf, axis_name, axis=axis, tiled=tiled, impl=impl, padded=False,
                                 axis_index_groups=axis_index_groups, to=to), x)
