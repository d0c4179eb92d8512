"""Small compatibility layer over the JAX versions jaxk3 supports (0.10.2 through 0.12).

Only `shard_map` differs: it lives at `jax.shard_map` (newer) or
`jax.experimental.shard_map.shard_map` (older), and its replication-check switch is called
`check_vma` (newer) or `check_rep` (older).  jaxk3 always turns the check off: the FFI gathers
are opaque custom calls whose outputs the checker cannot type.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import jax

try:  # jax >= 0.6 exports it at top level
    _shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map  # type: ignore

_PARAMS = inspect.signature(_shard_map).parameters
_CHECK_KW = "check_vma" if "check_vma" in _PARAMS else "check_rep"


def shard_map(f: Callable, mesh: jax.sharding.Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """`shard_map(f, mesh=..., in_specs=..., out_specs=...)` with the replication check off.

    Goes through `jaxk3.collectives.shard_map` when it exists: that wrapper records the concrete
    mesh while `f` is traced, which the FFI gathers need to pick their device group.
    """
    from jaxk3 import collectives

    sm = getattr(collectives, "shard_map", None)
    if sm is None:
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{_CHECK_KW: False})
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{_CHECK_KW: False})
