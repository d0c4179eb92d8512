"""``padded_all_gather``: the same result as :func:`all_gather`, always through the padded
transport."""
from __future__ import annotations

import jax

from jaxk3.collectives import settings
from jaxk3.collectives.gather import gather_leaf


def padded_all_gather(x, axis_name, *, axis_index_groups=None, axis: int = -1, tiled: bool = True,
                      to: str = "varying", impl: str = "auto"):
    """Like :func:`all_gather` (same result), always with the padded transport: each rank's row is
    padded to 16 bytes in flight and stripped on arrival.  For one-row projection outputs whose
    width per rank (e.g. 131 or 264 bf16 columns) is not a multiple of 16 bytes."""
    impl = settings.resolve_impl(impl)
    return jax.tree_util.tree_map(
        lambda leaf: gather_leaf(leaf, axis_name, axis=axis, tiled=tiled, impl=impl, padded=True,
                                 axis_index_groups=axis_index_groups, to=to), x)
