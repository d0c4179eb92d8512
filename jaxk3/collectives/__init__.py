"""One-shot collectives as XLA FFI custom calls, bitwise-equal to ``jax.lax``'s.

Call these inside ``jax.shard_map`` (axis names bound).  Each call decides *statically*, at
trace time and identically on every device, whether it takes the FFI fast path or falls back
to ``lax``; :func:`explain` reports that decision and its reason, :func:`plan` makes it.

The package, by concern:

- ``settings``: every environment variable (``JAXK3_GATHER``, ``JAXK3_GATHER_MAX_ROWS``,
  ``JAXK3_GATHER_MAX_BYTES``, ``JAXK3_GATHER_TIMEOUT_S``, ``JAXK3_DEBUG``), read and checked there
  and handed to C++;
- ``registry``: the compiled extension and its targets, registered with XLA once;
- ``context``: where a collective is traced (the bound axes, the concrete mesh) and the
  ``shard_map`` wrapper that records the mesh;
- ``groups``: device groups and their tables, the communicators (``reset``, ``set_timeout``);
- ``rules``: the group-level and op-level fallback rules; ``plan``: the decision, ``explain``;
- one module per op: ``gather`` (``all_gather``), ``padded`` (``padded_all_gather``),
  ``logits`` (``gather_logits``); ``floor`` (``local_tile``, the benchmark floor).
"""
from __future__ import annotations

from jaxk3.collectives.base import GatherUnavailableError, Plan
from jaxk3.collectives.context import shard_map
from jaxk3.collectives.floor import LOCAL_TILE_TARGET, local_tile
from jaxk3.collectives.gather import all_gather
from jaxk3.collectives.groups import reset, set_timeout
from jaxk3.collectives.logits import gather_logits
from jaxk3.collectives.padded import padded_all_gather
from jaxk3.collectives.plan import explain, plan
from jaxk3.collectives.registry import extension, extension_error
from jaxk3.collectives.rules import GATHER_DTYPES as SUPPORTED_DTYPES
from jaxk3.collectives.rules import ONE_SHOT_TARGET, PADDED_TARGET, TRANSPORT_ALIGN
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

__all__ = [
    "ENV_DEBUG", "ENV_IMPL", "ENV_MAX_BYTES", "ENV_MAX_ROWS", "ENV_TIMEOUT", "IMPLS",
    "LOCAL_TILE_TARGET", "ONE_SHOT_TARGET", "PADDED_TARGET", "SUPPORTED_DTYPES", "TRANSPORT_ALIGN",
    "GatherUnavailableError", "Plan",
    "all_gather", "default_impl", "explain", "extension", "extension_error", "gather_logits",
    "local_tile", "max_bytes", "max_rows", "padded_all_gather", "plan", "reset", "set_timeout",
    "shard_map",
]
