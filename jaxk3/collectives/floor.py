"""``local_tile``: a gather's output built from n local copies by one FFI call, no exchange.

The gather benchmark's ``ffi_floor``: what one FFI call of a gather's shape costs in a dependent
chain, with the exchange taken out."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxk3.collectives import registry
from jaxk3.collectives.layout import arrange
from jaxk3.collectives.planning import canonical_axis

LOCAL_TILE_TARGET = "jaxk3_local_tile"


def local_tile(x, n: int, *, axis: int = 0, tiled: bool = False):
    """What ``all_gather(x, axis=axis, tiled=tiled)`` over n ranks returns if every rank holds x:
    ``[n, *x.shape]`` from one FFI call (n local copies), then the gather's own re-layout."""
    x = jnp.asarray(x)
    platform = registry.FFI_PLATFORM.get(jax.devices()[0].platform, "CUDA")
    if not registry.has_target(platform, LOCAL_TILE_TARGET):
        raise RuntimeError(f"{LOCAL_TILE_TARGET} is not built for {platform}: rebuild the jaxk3 extension")
    stacked = jax.ffi.ffi_call(LOCAL_TILE_TARGET, jax.ShapeDtypeStruct((n, *x.shape), x.dtype))(x)
    return arrange(stacked, canonical_axis(axis, x.ndim, tiled), tiled)
