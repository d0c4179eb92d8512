"""Group resolution and the communicator registry.

A group is the set of devices that share every mesh coordinate outside the collective's axis
names; a device's rank is its coordinate along those names, row-major in the order given (as
lax numbers it).  Every collective's HLO carries the whole mesh as two tables (the same on
every device): ``table`` rows ``[process_index, ffi_ordinal, group_index, rank]`` and
``groups`` ``[num_groups, n]`` global device ids in rank order; a device finds its row by
(process, ordinal), and its group's ordered device list keys its communicator.

The communicators live in the extension: created on first use (CUDA: at plan time, by
:func:`communicators_ok`), dropped by :func:`reset`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxk3.collectives import registry, settings
from jaxk3.collectives.base import GatherUnavailableError


@dataclass(frozen=True)
class GroupTable:
    n: int
    table: tuple[int, ...]
    groups: tuple[int, ...]
    spans_processes: bool


def ffi_ordinal(d) -> int:
    """The number XLA's FFI reports as this device's ordinal (`Ctx<DeviceOrdinal>`).

    On CPU it is the global device id (seen: 2048.. in process 1 of a 2-process run, where
    local_hardware_id is 0..); on CUDA it is the process-local GPU ordinal."""
    if d.platform == "cpu" or d.local_hardware_id is None:
        return int(d.id)
    return int(d.local_hardware_id)


def resolve(mesh, names: tuple) -> GroupTable:
    """The groups of a collective over `names` of `mesh`."""
    axis_order = list(mesh.axis_names)
    devices = np.asarray(mesh.devices)
    gather_axes = [axis_order.index(n) for n in names]
    other_axes = [i for i in range(devices.ndim) if i not in gather_axes]
    # Put the other axes first, then the collective's axes in the order asked: rows are groups.
    arranged = np.transpose(devices, other_axes + gather_axes)
    n = int(np.prod([devices.shape[i] for i in gather_axes]))
    grouped = arranged.reshape(-1, n)
    table: list[int] = []
    groups: list[int] = []
    spans = False
    for g, row in enumerate(grouped):
        spans |= len({d.process_index for d in row}) > 1
        groups.extend(int(d.id) for d in row)
        for r, d in enumerate(row):
            table.extend((int(d.process_index), ffi_ordinal(d), g, r))
    return GroupTable(n, tuple(table), tuple(groups), spans)


def communicators_ok(platform: str, group: GroupTable) -> tuple[bool, str]:
    """Whether every group can have a communicator on `platform` (CUDA: made now, outside any
    execute: receive buffers, peer access, the kernel loaded on every GPU)."""
    if platform != "CUDA":
        return True, ""
    ext = registry.extension()
    check = getattr(ext, "cuda_group_ok", None)
    if check is None:
        return False, "no CUDA peer-access check in this build"
    ext.set_cuda_capacity_bytes(settings.cuda_capacity())
    for i in range(0, len(group.groups), group.n):
        ok, why = check(list(group.groups[i:i + group.n]))
        if not ok:
            return False, why
    return True, ""


def set_timeout(seconds: float) -> None:
    """Sets how long a rank waits for its peers before the collective fails (all communicators)."""
    seconds = settings.check_timeout(seconds)
    ext = registry.extension()
    if ext is None:
        raise GatherUnavailableError(registry.extension_error())
    ext.set_timeout_ms(int(round(seconds * 1000)))


def reset() -> None:
    """Forgets every communicator.  After a timeout a communicator refuses new rounds for one
    timeout period (or, if a peer never comes, until this); reset() ends that at once.  No
    collective may be in flight."""
    ext = registry.extension()
    if ext is not None:
        ext.reset()
