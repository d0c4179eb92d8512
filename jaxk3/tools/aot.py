"""Compiling for a GPU this machine does not have: XLA's deviceless compile through jax's CUDA plugin.

The plugin compiles a jitted function for a described device without a driver or a GPU
(`jax.experimental.topologies`): the same HLO passes, fusion decisions and Triton lowering of the Pallas
kernels as on the device, given the same XLA version and device description; the PTX is assembled by the
host's ptxas (the CUDA toolkit's, 13.0 here; the device image has CUDA 13). What it gives without a device:

- the kernel census of a step (`jaxk3 bench decode --census --target h200`): the launch ops and each
  block's kernels by kind, as the H200 compiles them;
- whether every kernel fits the target: a Pallas kernel asking for more shared memory than the device
  has fails its compile here ("Shared memory size limit exceeded"), as it would on the device.

What it does not give: times (nothing runs), and autotuning (XLA's GEMM fusions take their default tiles;
the kernel count is the same).

Checked against the device (docs/PERF.md, twenty-first session): at jax 0.11.2, the device image's, the
Kimi-Linear-48B step's launch ops at B = 1 and 8 and the K3 packed step's at B = 1 are those the H200's
census counted (281, 832, 192).

Needs the jax CUDA plugin of the device's jax (`make aot` makes `.venv-aot` with jax 0.11.2,
jax-cuda13-plugin and the extension's CUDA kernels), a ptxas on the PATH or in /usr/local/cuda, and
`JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1` before jax
starts its backends (`prepare()`): the plugin's check of the CUDA libraries' versions needs a driver,
and without the variable the plugin is not registered at all.
"""
from __future__ import annotations

import glob
import os
import re

import jax
import numpy as np
from jax.sharding import Mesh

from jaxk3.sharding import TP

SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"

# XLA's GpuTargetConfig (text proto) of one H200 SXM as the compile reads it. Measured on the lent H200s
# (docs/PERF.md): 132 SMs, 232,448 B of shared memory a block can opt into (the limit the first compiled
# MLA kernel hit), sm_90. Vendor figures: 4.8 TB/s HBM3e, 141 GB, 50 MB of L2, 1.98 GHz boost clock.
# The CUDA runtime is the device image's (CUDA 13, as docs/PERF.md records), and so is the driver's CUDA version
# (driver 580, CUDA 13.0): without one, XLA takes the driver for 0.0.0 and keeps custom calls (the jaxk3 CUDA
# kernels), cuBLAS and cuDNN out of its command buffers, which the device puts in them. XLA's cost model
# reads the bandwidth, clock and core count when it fuses; the others bound what a kernel may ask for.
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  driver_version: "13.0.0"
}
platform_name: "CUDA"
dnn_version_info {
  major: 9
  minor: 10
}
runtime_version {
  major: 13
  minor: 0
}
device_description_str: "NVIDIA H200"
"""

TARGETS = {"h200": H200}


class TargetUnavailable(RuntimeError):
    """This process cannot compile for the target (no jax CUDA plugin, or it did not register)."""


def prepare() -> None:
    """Let the CUDA plugin register without a driver: call before jax starts its backends (the CLI does
    before its first jax call; `tests/test_aot.py` at import)."""
    os.environ.setdefault(SKIP_CHECK, "1")


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"--target {target!r}: the known targets are {sorted(TARGETS)}")


def target_mesh(target: str, tp: int) -> Mesh:
    """A ("tp",) mesh of `tp` devices of `target`, described, not present: a jitted step lowered with
    abstract arguments on it (`jax.ShapeDtypeStruct`s with its shardings) compiles for that device."""
    check_target(target)
    if tp < 1:
        raise ValueError(f"--tp {tp}: must be at least 1")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[target], topology=f"1x1x{tp}")
    except Exception as e:  # NotImplementedError (no plugin) or the plugin's own error, by jax version
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        set_ = "set" if os.environ.get(SKIP_CHECK) else "not set"
        raise TargetUnavailable(
            f"target {target}: this jax ({jax.__version__}) cannot compile for CUDA without a GPU ({why}). It needs "
            f"jax's CUDA plugin (`make aot` makes .venv-aot with it) and {SKIP_CHECK}=1 before jax starts "
            f"(here {set_})") from None
    return Mesh(np.asarray(topo.devices[:tp]), (TP,))


def dump_options(directory: str) -> dict[str, str]:
    """`compile(compiler_options=...)` that has XLA write this compile's files to `directory` (among them its thunk
    sequence: every kernel's launch as the device would run it, `launches`)."""
    return {"xla_dump_to": directory}


_KERNEL = re.compile(r"^(\d+): kCustomKernel .*?\] (\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]"
                     r".*?shared_memory: (\d+) bytes")  # (a cluster shape, where there is one, before shared_memory)
_THUNK = re.compile(r"^(\d+): (k\w+)\s+(?:\[[^]]*\]\s*)?(\S+)")
_ANNOTATION = re.compile(r'profile_annotation: "([^"]+)"\s*thunk_id: (\d+)')


def launches(directory: str) -> list[dict]:
    """Each thunk of the one module XLA dumped to `directory` (`dump_options`), in order, from XLA's thunk sequence:
    for a kernel XLA launches itself (its fusions, the Pallas kernels), the HLO instruction it runs (`name`, as the
    census names kernels), its kernel's name, grid (CTAs), threads a CTA and shared memory at launch; for any other
    thunk (a custom call through the FFI such as the MXFP4 CUDA kernels, a copy, a collective) its `kind` and name
    alone. A while loop's body appears once. [] where the directory holds no thunk sequence."""
    seqs = sorted(glob.glob(os.path.join(directory, "*.thunk_sequence.txt")))
    if not seqs:
        return []
    if len(seqs) > 1:
        raise ValueError(f"{directory}: {len(seqs)} modules' thunk sequences; dump one compile a directory")
    meta = seqs[-1].replace(".thunk_sequence.txt", ".thunk_metadata.txt")
    names = {}
    if os.path.exists(meta):
        with open(meta) as fh:
            names = {int(i): n for n, i in _ANNOTATION.findall(fh.read())}
    out = []
    with open(seqs[-1]) as fh:
        for line in fh:
            m = _KERNEL.match(line.strip())
            if m:
                g = [int(x) for x in m.group(1, 3, 4, 5)]
                t = [int(x) for x in m.group(6, 7, 8)]
                out.append({"name": names.get(g[0], m.group(2)), "kind": "kCustomKernel", "kernel": m.group(2),
                            "ctas": g[1] * g[2] * g[3], "grid": g[1:], "threads": t[0] * t[1] * t[2],
                            "shared_memory": int(m.group(9))})
            elif (o := _THUNK.match(line.strip())) and o.group(2) not in ("kSequential", "kCommandBuffer"):
                if o.group(2) == "kCustomKernel":
                    raise ValueError(f"{seqs[-1]}: a kernel's launch in an unknown form: {line.strip()}")
                out.append({"name": names.get(int(o.group(1)), o.group(3)), "kind": o.group(2)})
    return out
