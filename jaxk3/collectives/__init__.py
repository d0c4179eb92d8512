"""One-shot collectives as XLA FFI custom calls: drop-ins for ``jax.lax.all_gather`` (bitwise)
and ``jax.lax.psum`` (bit-identical on every rank, float32 accumulation).

Call them wherever lax's would go: inside a plain ``jax.shard_map`` (in ``jax.jit``, loop bodies,
nested jits; the devices are resolved when the program is lowered), or anywhere else, where a
form the fast path does not serve goes to lax with every argument.  Each call decides
*statically* and identically on every device whether it takes the FFI path; :func:`explain`
reports that decision and its reason, :func:`plan` makes it.

The package, by concern:

- ``settings``: every environment variable (``JAXK3_GATHER``, ``JAXK3_GATHER_MAX_ROWS``,
  ``JAXK3_GATHER_MAX_BYTES``, ``JAXK3_GATHER_TIMEOUT_S``, ``JAXK3_DEBUG``), read and checked there
  and handed to C++;
- ``cpu_pool``: XLA's CPU client thread pool, sized before the client exists (jaxlib < 0.12: a
  queue of un-awaited launches otherwise starves the running one of threads);
- ``registry``: the compiled extension, its targets and types, registered with XLA once;
- ``context``: where a collective is traced or lowered (axes, mesh, platform); ``shard_map``;
- ``groups``: device groups and their tables, the communicators (``reset``, ``set_timeout``);
- ``interface``: the forms of lax's collectives that lax serves (decided when traced);
- ``rules``: the group-level and op-level rules; ``planning``: ``plan`` and ``explain``;
- ``lowering``: the lowering rule the primitives share (the final decision, with devices);
- one module per op: ``gather`` (``all_gather``), ``padded`` (``padded_all_gather``),
  ``logits`` (``gather_logits``), ``allreduce`` (``psum``); ``floor`` (``local_tile``, the
  benchmark floor); ``roofline``: rules that make ``jax.experimental.roofline`` count them as
  lax's collectives.
"""
from __future__ import annotations

# First: sizes XLA's CPU pool while jax has not created its CPU client yet (jaxlib < 0.12).
from jaxk3.collectives import cpu_pool  # noqa: F401
from jaxk3.collectives.base import GatherUnavailableError, Plan
from jaxk3.collectives.context import shard_map
from jaxk3.collectives.floor import LOCAL_TILE_TARGET, local_tile
from jaxk3.collectives.gather import all_gather
from jaxk3.collectives.groups import reset, set_timeout
from jaxk3.collectives.logits import gather_logits
from jaxk3.collectives.padded import padded_all_gather
from jaxk3.collectives.planning import explain, plan
from jaxk3.collectives.allreduce import psum
from jaxk3.collectives import roofline as _roofline
from jaxk3.collectives.registry import extension, extension_error
from jaxk3.collectives.rules import GATHER_DTYPES as SUPPORTED_DTYPES
from jaxk3.collectives.rules import ALL_REDUCE_TARGET, ONE_SHOT_TARGET, PADDED_TARGET, TRANSPORT_ALIGN
from jaxk3.collectives.settings import (
    ENV_DEBUG,
    ENV_IMPL,
    ENV_MAX_BYTES,
    ENV_MAX_ROWS,
    ENV_TIMEOUT,
    IMPLS,
    default_impl,
    max_bytes,
    max_rows,
)

# JAX's roofline cost model counts our collectives as lax's (a no-op where jax has no such module).
_roofline.register()

__all__ = [
    "ENV_DEBUG", "ENV_IMPL", "ENV_MAX_BYTES", "ENV_MAX_ROWS", "ENV_TIMEOUT", "IMPLS",
    "ALL_REDUCE_TARGET", "LOCAL_TILE_TARGET", "ONE_SHOT_TARGET", "PADDED_TARGET", "SUPPORTED_DTYPES", "TRANSPORT_ALIGN",
    "GatherUnavailableError", "Plan",
    "all_gather", "default_impl", "explain", "extension", "extension_error", "gather_logits",
    "local_tile", "max_bytes", "max_rows", "padded_all_gather", "plan", "psum", "reset", "set_timeout",
    "shard_map",
]
