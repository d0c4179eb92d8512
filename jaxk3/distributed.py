"""Multi-process runs on JAX's own runtime (`jax.distributed`): DP across processes, TP inside.

The usual layout: one process per host, tensor parallelism over the GPUs of a host (NVLink,
one-shot gathers), data parallelism across hosts.  A gather over a group that lives in one
process takes the FFI path; a group spanning processes falls back to `lax.all_gather` (XLA's
NCCL on GPU, gloo on CPU), decided statically in `collectives.plan`.  docs/DISTRIBUTED.md says
how to launch it.
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from jaxk3.sharding import DP, TP

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               heartbeat_timeout_s: int = 100, initialization_timeout_s: int = 300) -> bool:
    """Starts `jax.distributed` if asked to (arguments, or the JAX_* variables above); returns
    whether this is a multi-process run.  Must run before anything touches a JAX backend.

    CPU processes exchange through gloo.  `heartbeat_timeout_s` bounds how long the survivors
    wait before a dead process is reported as an error (JAX's coordination service)."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = int(os.environ[ENV_PROCESS_ID])
    if coordinator is None and num_processes in (None, 1):
        return False
    missing = [n for n, v in (("coordinator address", coordinator), ("number of processes", num_processes),
                              ("process id", process_id)) if v is None]
    if missing:
        raise ValueError(f"multi-process run: missing {', '.join(missing)} (pass them, or set "
                         f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is outside [0, {num_processes})")
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or os.environ.get("JAX_PLATFORM_NAME") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               initialization_timeout=initialization_timeout_s)
    return True


def add_cli_args(parser) -> None:
    """The multi-process options shared by `jaxk3 generate` and `jaxk3 bench decode`."""
    mp = parser.add_argument_group(
        "multi-process (jax.distributed; docs/DISTRIBUTED.md)",
        "Every process runs the same command with its own --process-id (or the variables "
        f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}). The mesh is (dp, tp): TP over "
        "each process's devices (--tp of them), the batch split over dp.")
    mp.add_argument("--coordinator", metavar="HOST:PORT", default=None, help="address of process 0's coordinator")
    mp.add_argument("--num-processes", type=int, default=None, metavar="N")
    mp.add_argument("--process-id", type=int, default=None, metavar="I")
    mp.add_argument("--heartbeat-timeout", type=int, default=100, metavar="S",
                    help="seconds before a dead process is reported (default 100)")


def initialize_from_args(args) -> bool:
    """`initialize` with the options of `add_cli_args`."""
    return initialize(args.coordinator, args.num_processes, args.process_id,
                      heartbeat_timeout_s=args.heartbeat_timeout)


def make_mesh(tp: int | None = None) -> Mesh:
    """A ("dp", "tp") mesh over every process's devices: each TP group inside one process
    (`tp` defaults to the local device count), the rest data-parallel."""
    local = jax.local_device_count()
    tp = local if tp is None else tp
    if tp < 1 or local % tp:
        raise ValueError(f"tp={tp} must divide the {local} devices of each process")
    # jax.devices() lists devices process by process, so rows of `tp` never cross a process.
    devices = np.asarray(jax.devices()).reshape(-1, tp)
    return Mesh(devices, (DP, TP))
