"""Device kernels: one registry, and a jnp reference path beside every kernel.

A kernel is registered once (`register`), as a `Kernel`: its name, its jnp `reference` (the path
every platform can run: the CPU path and the kernel's test oracle), its device implementation
(`device`, written in Pallas where Pallas reaches the target; C++/CUDA goes in ffi/), the
platforms the device implementation runs on, and `fits(*args)`, which says why a call's shapes do
not suit the kernel (None when they do).  Callers go through `call(name, *args, mode=...)`:

    mode "auto"  the device kernel where the platform has it, the shapes fit and the kernel has been
                 proven on that platform's hardware (`Kernel.unproven` is None), else the reference
    mode "off"   always the reference
    mode "on"    the device kernel or a KernelUnavailableError naming the reason

`explain(name, *args, mode=, platform=)` says which path a call takes and why; `active(platform)`
lists what `auto` selects per kernel.  Adding a kernel: one file here that defines both paths
and calls `register`, plus its import line below (docs/ARCHITECTURE.md, "How to add a kernel").
"""
from __future__ import annotations

from jaxk3.kernels.registry import (MODES, REGISTRY, Kernel, KernelUnavailableError, active, call,  # noqa: F401
                                    explain, register, speeds, status)
from jaxk3.kernels import (attn_res_norm, gemv, kda_decode, kda_prefill, mla_decode,  # noqa: E402,F401,I001
                           mla_prefill, mla_prep, moe_experts, moe_grouped, rms_norm, router)
