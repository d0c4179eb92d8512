"""JAX's roofline cost model (``jax.experimental.roofline``) counts jaxk3's collectives as lax's.

The roofline interpreter walks a jaxpr and asks a rule per primitive for flops, HBM bytes and
the ICI bytes and latency of collectives; a primitive without a rule contributes nothing (and a
warning).  ``jaxk3_all_gather`` and ``jaxk3_psum`` would therefore count no ICI traffic where
``lax.all_gather`` and ``lax.psum`` count a ring collective (and a grad counted only the
reduce-scatter of lax's transpose: half).  The rules here hand each of our equations to the
rule jax has for the lax primitive lax would have bound, with lax's parameters:

- ``jaxk3_all_gather`` -> ``all_gather_p`` (``all_gather_dimension=axis``, no index groups);
- ``jaxk3_psum`` -> ``psum_invariant_p`` under shard_map's type check (``invariant=True``),
  else ``psum_p`` (as ``lax.psum`` binds one or the other).

lax's rule is looked up when the rule runs (not when registered), so the import order of jax's
rule module does not matter and a jax without a rule for the lax primitive counts nothing for
ours either.  The cost model is the same whichever transport the lowering picks (the FFI
one-shot gather moves the same bytes over the same links as lax's ring, in one step).

Every version of JAX jaxk3 supports (0.10.2 through 0.12) has the module; where it cannot be
imported (a jax without it, or jax 0.10's ``absl`` import missing) nothing is registered and
:func:`registered` says why.  Everything here reaches into ``jax._src`` and is guarded.
"""
from __future__ import annotations

import dataclasses
import importlib

_why_not: str | None = "not attempted"


def _module():
    """The module holding ``_rooflines`` and ``RooflineResult`` (jax's roofline interpreter)."""
    # The package imports jax's rules (rooflines.py); its attribute `roofline` is the function,
    # so the module is taken from sys.modules.
    mod = importlib.import_module("jax.experimental.roofline.roofline")
    if not isinstance(getattr(mod, "_rooflines", None), dict):
        raise ImportError("jax.experimental.roofline.roofline has no _rooflines table")
    return mod


def _lax_parallel():
    from jax._src.lax import parallel

    return parallel


def _delegate(mod, ctx, args, lax_prim, params):
    """lax's rule for `lax_prim` applied to our equation, or nothing when jax has none."""
    rule = mod._rooflines.get(lax_prim)
    if rule is None:
        return mod.RooflineResult.zeros()
    try:
        ctx = dataclasses.replace(ctx, primitive=lax_prim)
    except (TypeError, ValueError):  # pragma: no cover - a context that is not a dataclass
        pass
    return rule(ctx, *args, **params)


def _all_gather_rule(mod, par):
    def rule(ctx, *args, axis_name, axis, tiled, axis_size, **_):
        return _delegate(mod, ctx, args, par.all_gather_p, dict(
            all_gather_dimension=axis, axis_name=tuple(axis_name), axis_index_groups=None,
            axis_size=axis_size, tiled=tiled))
    return rule


def _psum_rule(mod, par):
    def rule(ctx, *args, axes, invariant, **_):
        if invariant and hasattr(par, "psum_invariant_p"):
            return _delegate(mod, ctx, args, par.psum_invariant_p, dict(axes=tuple(axes)))
        return _delegate(mod, ctx, args, par.psum_p, dict(axes=tuple(axes), axis_index_groups=None))
    return rule


def register() -> bool:
    """Registers the rules for ``jaxk3_all_gather`` and ``jaxk3_psum`` (once; idempotent).
    False, silently, where this jax has no roofline module (:func:`registered` says why)."""
    global _why_not
    if _why_not is None:
        return True
    try:
        mod = _module()
        par = _lax_parallel()
        from jaxk3.collectives.allreduce import psum_p
        from jaxk3.collectives.gather import all_gather_p

        mod._rooflines[all_gather_p] = _all_gather_rule(mod, par)
        mod._rooflines[psum_p] = _psum_rule(mod, par)
    except Exception as e:  # ImportError (no module, no absl on jax 0.10), or a changed jax._src
        _why_not = f"jax's roofline module is not usable here ({type(e).__name__}: {e})"
        return False
    _why_not = None
    return True


def registered() -> str | None:
    """None when the rules are registered, else why not."""
    return _why_not
