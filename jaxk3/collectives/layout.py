"""Rank-major stacks to lax's layouts: the FFI gathers return ``[n, *x.shape]`` (row r = rank r's
operand); lax.all_gather puts the new axis at ``axis`` (``tiled``: merged into it)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def arrange(stacked: jax.Array, axis: int, tiled: bool) -> jax.Array:
    """``[n, *shape]`` rank-major -> lax.all_gather's layout for a canonical (axis, tiled)."""
    moved = jnp.moveaxis(stacked, 0, axis)
    if not tiled:
        return moved
    shape = list(moved.shape)
    shape[axis:axis + 2] = [shape[axis] * shape[axis + 1]]
    return moved.reshape(shape)
