"""The fallback rules, in two kinds.

Group-level rules: whether the devices a collective spans can take the FFI path at all (a group
of one device, a partially manual shard_map, no concrete mesh, no handler for the platform, a
group spanning processes, on CPU a call site that may repeat, no extension, no communicator).

Op-level rules: whether this operand can (dtype, empty payload, rows, bytes per rank) and which
transport moves it (the layout: payloads that are not a multiple of 16 bytes take the padded
target).

Each rule returns None when it does not object, else the reason.  :mod:`plan` applies them.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxk3.collectives import context, groups, registry, settings
from jaxk3.collectives.context import Axes

ONE_SHOT_TARGET = "jaxk3_one_shot_all_gather"
PADDED_TARGET = "jaxk3_padded_all_gather"
TRANSPORT_ALIGN = 16  # bytes; the padded variant pads each rank's payload to this

# Dtypes the gathers move as plain bytes.  Sub-byte and exotic types fall back.
GATHER_DTYPES = frozenset(
    np.dtype(d)
    for d in (
        np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
        np.uint64, np.float16, jnp.bfloat16, np.float32, np.float64,
    )
)


@dataclass(frozen=True)
class Group:
    """A group that passed the group-level rules: n ranks on FFI platform `platform`."""

    n: int
    platform: str
    table: groups.GroupTable


# ---------------------------------------------------------------------------------------
# Group-level rules.
# ---------------------------------------------------------------------------------------

def group_size(names: tuple, axes: Axes) -> int:
    """The number of devices in the group; a NameError for names not bound here."""
    missing = [n for n in names if n not in axes.sizes]
    if missing:
        raise NameError(f"unbound axis name(s) {missing}: call the collectives inside shard_map")
    return int(np.prod([axes.sizes[a] for a in names]))


def resolve_group(names: tuple, axes: Axes, mesh, *, mesh_given: bool) -> Group | str:
    """The group of a collective over `names` (n > 1), or why it cannot take the FFI path.
    Pure: nothing is loaded or created."""
    n = group_size(names, axes)
    not_manual = axes.not_manual()
    if not_manual:
        return f"mesh axes {not_manual} are not manual (partial shard_map)"
    m = mesh if mesh_given else context.current_mesh()
    if m is None:
        return "the concrete mesh is unknown here: use jaxk3.shard_map or jax.set_mesh"
    if any(a not in m.axis_names for a in names):
        return f"axis {names} not in the mesh in context {tuple(m.axis_names)}"
    jax_platform = groups.platform_of(m)
    platform = registry.FFI_PLATFORM.get(jax_platform)
    if platform is None:
        return f"no jaxk3 handler for platform {jax_platform!r}"
    if platform == "cpu" and not mesh_given and not context.in_body_trace():
        # The CPU transport matches calls by call site and per-device generation.  A nested
        # jax.jit's trace is cached and inlined once per call (one site, several instances), and
        # XLA's CPU runtime may run independent instances in a different order per device.
        return ("on CPU the FFI gather must be traced directly in a jaxk3.shard_map body "
                "(not in a nested jax.jit, loop body or cond branch, whose call sites may repeat)")
    table = groups.resolve(m, names)
    if table.spans_processes:
        return "the group spans processes (XLA's collectives handle that)"
    return Group(n, platform, table)


def activate_group(group: Group) -> str | None:
    """Loads what the group's FFI path needs (the extension, the platform's targets, CUDA
    communicators); the reason when something is missing."""
    if registry.extension() is None:
        registry.warn_once("ext", f"jaxk3 gathers fall back to lax.all_gather: {registry.extension_error()}")
        return registry.extension_error() or "extension unavailable"
    if not registry.register(group.platform):
        registry.warn_once(group.platform, f"jaxk3 was built without {group.platform} handlers; "
                                           "gathers fall back to lax.all_gather")
        return f"this jaxk3 build has no {group.platform} handler"
    ok, why = groups.communicators_ok(group.platform, group.table)
    return None if ok else why


# ---------------------------------------------------------------------------------------
# Op-level rules.
# ---------------------------------------------------------------------------------------

def payload_bytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def rows_of(shape) -> int:
    """Rows of an operand: all dims but the last (1 for rank < 2)."""
    return int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) >= 2 else 1


def operand_refusal(shape, dtype, supported=GATHER_DTYPES) -> str | None:
    """Dtype, empty payload and rows: the rules that need no platform."""
    dt = np.dtype(dtype)
    if dt not in supported:
        return f"dtype {dt.name} is not moved by the FFI gathers"
    if payload_bytes(shape, dt) == 0:
        return "empty payload"
    rows, limit = rows_of(shape), settings.max_rows()
    if rows > limit:
        return f"{rows} rows > {settings.ENV_MAX_ROWS}={limit} (prefill-sized)"
    return None


def bytes_refusal(nbytes: int, platform: str) -> str | None:
    limit = settings.max_bytes(platform)
    if nbytes > limit:
        return (f"{nbytes} bytes per rank > {settings.ENV_MAX_BYTES}={limit} (the {platform} default"
                " is where the FFI path stops beating lax)")
    return None


def gather_layout(nbytes: int, padded: bool) -> tuple[str, str]:
    """(target, reason) of an eligible gather: unaligned payloads take the padded transport."""
    unaligned = nbytes % TRANSPORT_ALIGN != 0
    target = PADDED_TARGET if (padded or unaligned) else ONE_SHOT_TARGET
    if unaligned and not padded:
        return target, (f"eligible; {nbytes} bytes per rank is not a multiple of {TRANSPORT_ALIGN}, "
                        "so the padded transport")
    return target, "eligible"
