"""Lower a function's Pallas kernels to Triton IR for an sm_90 GPU on a machine without one (the CPU): what a
kernel's first GPU call would refuse at lowering (an unsupported primitive, a block that is not a power of two)
shows up here first.  The IR is not compiled to PTX (XLA does that on the GPU: register and shared-memory limits
are still the device's to find).  jax 0.10 lowers for sm_90 when it finds no GPU; jax 0.11-0.12 ask the GPU for
its compute capability, so `abstract_sm90` answers that query (a private hook of pallas.triton) with 9.0."""
from __future__ import annotations

import types

import jax

TRITON_TARGET = "__gpu$xla.gpu.triton"


def abstract_sm90() -> None:
    """Make pallas.triton lower for compute capability 9.0 (an H200's) without a GPU (no-op where it already does)."""
    from jax._src.pallas.triton import pallas_call_registration as R

    if hasattr(R, "gpu_info_lib"):
        R.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability="9.0")


def lower(fn, *args) -> int:
    """Export jit(fn)(*args) for CUDA (its Pallas kernels lowered to Triton IR); the number of Triton kernels."""
    abstract_sm90()
    e = jax.export.export(jax.jit(fn), platforms=["cuda"],
                          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)])(*args)
    return e.mlir_module().count("xla.gpu.triton")
