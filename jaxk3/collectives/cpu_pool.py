"""Sizes XLA's CPU client thread pool before the client exists (jaxlib < 0.12 only).

Why (docs/ARCHITECTURE.md, "Known limit"): jaxlib 0.10's CPU client runs two kinds of work on
one pool of ``max(cores, devices)`` threads.  A multi-device launch first takes a slot of each
device's in-flight semaphore (32 launches a device) on a pool thread, and *blocks that thread*
when the device already has 32 launches in flight; then each device's execution of a launch
holds a pool thread until its program is done, and a collective's program is done only when
every device has run it.  With more than 32 launches queued, ``devices`` threads blocked on the
semaphore (per Python thread dispatching) leave fewer than ``devices`` threads for the running
launch: it never completes (lax aborts the process; jaxk3 times out).  Measured at 8 devices on
jaxlib 0.10.2: 16 threads run 2,000 queued launches from one Python thread, 15 do not; 24/23
for two threads, 32/31 for three.  jaxlib 0.12 runs executions on a pool of their own and needs
nothing.

The pool is sized once, from ``PJRT_NPROC`` (or ``NPROC``), when jax creates its CPU client.  So
when the client does not exist yet, neither variable is set and the jaxlib shares its pool, this
sets ``PJRT_NPROC`` to ``max(cores, 4 x cpu devices)``: room for three Python threads that queue
launches without waiting.  Imported before anything else of the collectives.
"""
from __future__ import annotations

import os
import re

# Python threads that may queue launches without waiting, beyond the running launch itself.
DISPATCHING_THREADS = 3


def _jaxlib_version() -> tuple[int, ...]:
    import jaxlib.version

    info = getattr(jaxlib.version, "__version_info__", None)
    if info is None:
        info = tuple(int(p) for p in re.findall(r"\d+", jaxlib.version._version)[:3])
    return tuple(info)


def cpu_device_count() -> int:
    """The CPU devices jax will create: ``jax_num_cpu_devices``, else XLA_FLAGS, else 1."""
    import jax

    n = getattr(jax.config, "jax_num_cpu_devices", -1)
    if n is not None and n >= 0:
        return int(n)
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1


def threads_needed(devices: int, cores: int) -> int:
    return max(cores, (DISPATCHING_THREADS + 1) * devices)


def size_for_collectives() -> str:
    """Sets PJRT_NPROC when it matters and still can; returns what it did (for tests, ``info``)."""
    if os.environ.get("PJRT_NPROC") or os.environ.get("NPROC"):
        return "left as set"
    if _jaxlib_version() >= (0, 12):
        return "not needed (executions have a pool of their own)"
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return "too late (the CPU client exists)"
    devices = cpu_device_count()
    if devices <= 1:
        return "not needed (one CPU device)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["PJRT_NPROC"] = str(threads_needed(devices, cores))
    return "PJRT_NPROC=" + os.environ["PJRT_NPROC"]


STATUS = size_for_collectives()
