"""``all_gather``: ``lax.all_gather``'s result, bitwise, through the one-shot FFI gather where the
plan allows it."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxk3 import _compat
from jaxk3.collectives import settings
from jaxk3.collectives.base import GatherUnavailableError, Plan
from jaxk3.collectives.layout import arrange
from jaxk3.collectives.plan import axis_names, canonical_axis, plan

_site_ids = itertools.count(1)


def ffi_gather(x: jax.Array, p: Plan) -> jax.Array:
    """Rank-major gather through the plan's target: returns [n, *x.shape], row r = rank r's x."""
    out = jax.ShapeDtypeStruct((p.group_size, *x.shape), x.dtype)
    call = jax.ffi.ffi_call(p.target, out)
    return call(
        x,
        site=np.int64(next(_site_ids)),
        group_size=np.int64(p.group_size),
        table=np.asarray(p.table, dtype=np.int64),
        groups=np.asarray(p.groups, dtype=np.int64),
    )


def gather_leaf(x, axis_name, axis: int, tiled: bool, impl: str, padded: bool):
    """One array's gather (impl already resolved)."""
    x = jnp.asarray(x)
    if tiled and x.ndim == 0:
        raise ValueError("tiled all_gather needs an array of rank >= 1")
    a = canonical_axis(axis, x.ndim, tiled)
    p = plan(x.shape, x.dtype, axis_name, padded=padded, impl=impl)
    if p.path == "identity":
        return x if tiled else jnp.expand_dims(x, a)
    if p.path == "lax":
        if impl == "ffi":
            raise GatherUnavailableError(f"impl='ffi' but the FFI gather does not apply: {p.reason}")
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
    y = ffi_gather(x, p)
    # Type it as lax.all_gather's result: varying over the gathered axes (and whatever x varied
    # over); the custom call's output carries no such type by itself.
    have = _compat.varying_axes(y)
    missing = tuple(n for n in (*axis_names(axis_name), *sorted(_compat.varying_axes(x))) if n not in have)
    if missing:
        y = _compat.make_varying(y, tuple(dict.fromkeys(missing)))
    return arrange(y, a, tiled)


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False, impl: str = "auto"):
    """``lax.all_gather(x, axis_name, axis=axis, tiled=tiled)``, bitwise, through the one-shot FFI
    gather where eligible.  Accepts a pytree, a single axis name or a tuple of names."""
    impl = settings.resolve_impl(impl)
    return jax.tree_util.tree_map(lambda leaf: gather_leaf(leaf, axis_name, axis, tiled, impl, False), x)
