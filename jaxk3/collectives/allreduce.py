"""``psum``: ``lax.psum``'s semantics (pytrees, tuple axes, any shape), through the FFI
all-reduce where the plan allows it.

The FFI all-reduce sums every rank's operand in a fixed rank order, bfloat16 and float16 in a
float32 accumulator rounded once, so the result is bit-identical on every rank; it matches
lax.psum to float32-accumulation rounding (exactly for integers).  The primitive,
``jaxk3_psum``, is typed like lax's psum under shard_map's type check (varying -> invariant
over the summed axes) and without it; its tangent is the same sum, its transpose lax's (a cast
to varying, or a psum without the type check), and under vmap it sums the batched operand.
The CUDA all-reduce is not written yet: on CUDA the plan says so and lax sums.
"""
from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxk3 import _compat
from jaxk3.collectives import interface, settings
from jaxk3.collectives.base import GatherUnavailableError, Plan
from jaxk3.collectives.context import Axes
from jaxk3.collectives.lowering import ffi_attributes, lower_collective
from jaxk3.collectives.planning import plan

psum_p = Primitive("jaxk3_psum")


def _abstract_eval(x, *, axes, invariant, strict):
    if invariant:
        x = _compat.with_type(x, varying=_compat.varying_axes(x) - set(axes))
    return x, _compat.named_axis_effects(axes)


def _emit(x, p: Plan):
    return jax.ffi.ffi_call(p.target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, **ffi_attributes(p))


def _lower(ctx, x, *, axes, invariant, strict):
    return lower_collective(ctx, x, op="psum", names=axes, padded=False, strict=strict, emit=_emit,
                            fallback=lambda v: _compat.lax_psum(v, axes))


def _transpose(ct, x, *, axes, invariant, strict):
    if invariant:  # lax's psum under the type check: its transpose casts back to varying
        return [_compat.make_varying(ct, axes)]
    return [psum_p.bind(ct, axes=axes, invariant=False, strict=strict)]  # without: a psum again


def _batch(vals, dims, **params):
    (x,), (d,) = vals, dims
    return psum_p.bind(x, **params), d


psum_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(psum_p, _lower, cacheable=False)
ad.deflinear2(psum_p, _transpose)
batching.primitive_batchers[psum_p] = _batch


def _summed_names(axis_name) -> tuple:
    """The axes lax.psum sums over (it drops size-one mesh axes when jax is so configured)."""
    names = interface.names_of(axis_name)
    if _compat.size_one_axes_dropped():
        sizes = Axes.here().sizes
        names = tuple(n for n in names if sizes.get(n) != 1)
    return names


def psum_leaf(x, axis_name, *, impl: str, axis_index_groups=None):
    """One array's sum (impl already resolved): lax's, or the FFI primitive."""

    def by_lax(p: Plan):
        if impl == "ffi" and p.path == "lax":
            raise GatherUnavailableError(f"impl='ffi' but the FFI all-reduce does not apply: {p.reason}")
        return _compat.lax_psum(x, axis_name, axis_index_groups=axis_index_groups)

    refused = interface.refusal("psum", x, axis_name, axis_index_groups=axis_index_groups)
    if refused is not None:
        return by_lax(refused)
    names = _summed_names(axis_name)
    p = plan(jax.numpy.shape(x), x.dtype, names, impl=impl, op="psum")
    if p.path != "ffi":
        return by_lax(p)
    return psum_p.bind(x, axes=names, invariant=_compat.vma_checked(), strict=impl == "ffi")


def psum(x, axis_name, *, axis_index_groups=None, impl: str = "auto"):
    """``_compat.lax_psum(x, axis_name, axis_index_groups=...)`` through the FFI all-reduce where
    eligible: the sum in rank order (float32 accumulation for bfloat16/float16), bit-identical on
    every rank.  A pytree, one axis name or a tuple; a form the FFI path does not serve goes to
    lax with every argument."""
    impl = settings.resolve_impl(impl)
    return jax.tree_util.tree_map(lambda leaf: psum_leaf(leaf, axis_name, impl=impl,
                                                         axis_index_groups=axis_index_groups), x)
