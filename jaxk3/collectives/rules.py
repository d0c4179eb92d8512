"""The fallback rules, in two kinds.

Group-level rules: whether the devices a collective spans can take the FFI path at all (a
partially manual shard_map, no handler for the platform, unknown devices at lowering, a group
spanning processes, no extension, no communicator).

Op-level rules: whether this operand can (dtype, empty payload, rows, bytes per rank, the
platforms the op has a handler on) and which target moves it (a gather whose payload is not a
multiple of 16 bytes takes the padded transport).

Each rule returns None when it does not object, else the reason.  :mod:`plan` applies them.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxk3.collectives import groups, registry, settings
from jaxk3.collectives.context import Axes, Where

ONE_SHOT_TARGET = "jaxk3_one_shot_all_gather"
PADDED_TARGET = "jaxk3_padded_all_gather"
ALL_REDUCE_TARGET = "jaxk3_all_reduce"
TRANSPORT_ALIGN = 16  # bytes; the padded variant pads each rank's payload to this

_INTS = (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)
_FLOATS = (np.float16, jnp.bfloat16, np.float32, np.float64)
# Dtypes the gathers move as plain bytes.  Sub-byte and exotic types fall back.
GATHER_DTYPES = frozenset(np.dtype(d) for d in (np.bool_, *_INTS, *_FLOATS))
# Dtypes the all-reduce sums (bool is summed by lax as int32; complex and float8 fall back).
SUM_DTYPES = frozenset(np.dtype(d) for d in (*_INTS, *_FLOATS))


@dataclass(frozen=True)
class Op:
    """What the op-level rules need to know about a collective."""

    name: str            # "all_gather", "psum"
    noun: str            # for reasons: "gather", "all-reduce"
    dtypes: frozenset
    platforms: tuple     # FFI platforms with a handler for it


GATHER = Op("all_gather", "gather", GATHER_DTYPES, ("cpu", "CUDA"))
PSUM = Op("psum", "all-reduce", SUM_DTYPES, ("cpu",))
OPS = {op.name: op for op in (GATHER, PSUM)}


@dataclass(frozen=True)
class Group:
    """A group that passed the group-level rules: n ranks on FFI platform `platform`; `table` is
    None until the devices are known (resolved when the program is lowered)."""

    n: int
    platform: str
    table: groups.GroupTable | None


# ---------------------------------------------------------------------------------------
# Group-level rules.
# ---------------------------------------------------------------------------------------

def group_size(names: tuple, axes: Axes) -> int:
    """The number of devices in the group; a NameError for names not bound here."""
    missing = [n for n in names if n not in axes.sizes]
    if missing:
        raise NameError(f"unbound axis name(s) {missing}: call the collectives inside shard_map")
    return int(np.prod([axes.sizes[a] for a in names]))


def resolve_group(names: tuple, where: Where) -> Group | str:
    """The group of a collective over `names` (n > 1), or why it cannot take the FFI path.
    Pure: nothing is loaded or created."""
    n = group_size(names, where.axes)
    not_manual = where.axes.not_manual()
    if not_manual:
        return f"mesh axes {not_manual} are not manual (partial shard_map)"
    platform = registry.FFI_PLATFORM.get(where.platform or "")
    if platform is None:
        return f"no jaxk3 handler for platform {where.platform!r}"
    m = where.mesh
    if m is None:
        if where.lowering:
            return "the devices are unknown when lowered (shard_map over an abstract mesh, no jax.set_mesh)"
        return Group(n, platform, None)
    if any(a not in m.axis_names for a in names):
        return f"axis {names} not in the mesh in context {tuple(m.axis_names)}"
    table = groups.resolve(m, names)
    if table.spans_processes:
        return "the group spans processes (XLA's collectives handle that)"
    return Group(n, platform, table)


def activate_group(group: Group) -> str | None:
    """Loads what the group's FFI path needs (the extension, the platform's targets, CUDA
    communicators); the reason when something is missing."""
    if registry.extension() is None:
        registry.warn_once("ext", f"jaxk3 collectives fall back to lax: {registry.extension_error()}")
        return registry.extension_error() or "extension unavailable"
    if not registry.register(group.platform):
        registry.warn_once(group.platform, f"jaxk3 was built without {group.platform} handlers; "
                                           "collectives fall back to lax")
        return f"this jaxk3 build has no {group.platform} handler"
    if group.table is None:
        return None
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


def operand_refusal(shape, dtype, op: Op = GATHER) -> str | None:
    """Dtype, empty payload and rows: the rules that need no platform."""
    dt = np.dtype(dtype)
    if dt not in op.dtypes:
        return f"dtype {dt.name} is not moved by the FFI {op.noun}"
    if payload_bytes(shape, dt) == 0:
        return "empty payload"
    rows, limit = rows_of(shape), settings.max_rows()
    if rows > limit:
        return f"{rows} rows > {settings.ENV_MAX_ROWS}={limit} (prefill-sized)"
    return None


def platform_refusal(op: Op, platform: str) -> str | None:
    if platform not in op.platforms:
        return f"no FFI {op.noun} on {platform} yet (handlers on {', '.join(op.platforms)})"
    return None


def bytes_refusal(nbytes: int, platform: str) -> str | None:
    limit = settings.max_bytes(platform)
    if nbytes > limit:
        return (f"{nbytes} bytes per rank > {settings.ENV_MAX_BYTES}={limit} (the {platform} default"
                " is where the FFI path stops beating lax)")
    return None


def layout(op: Op, nbytes: int, padded: bool) -> tuple[str, str]:
    """(target, reason) of an eligible collective: gathers of unaligned payloads take the padded
    transport."""
    if op is PSUM:
        return ALL_REDUCE_TARGET, "eligible"
    unaligned = nbytes % TRANSPORT_ALIGN != 0
    target = PADDED_TARGET if (padded or unaligned) else ONE_SHOT_TARGET
    if unaligned and not padded:
        return target, (f"eligible; {nbytes} bytes per rank is not a multiple of {TRANSPORT_ALIGN}, "
                        "so the padded transport")
    return target, "eligible"


def multi_process_note() -> str:
    return "" if jax.process_count() == 1 else " (lax if the group turns out to span processes)"
