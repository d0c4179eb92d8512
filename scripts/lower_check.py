"""Lower Pallas kernels to Triton IR for an sm_90 GPU on a machine without one (the CPU): what a kernel's
first GPU call would refuse at lowering (an unsupported primitive, a shape Triton cannot take) shows up here
first.  It does not compile the IR to PTX (XLA does that on the GPU: register and shared-memory limits are
still the device's to find), and it patches a private JAX hook (pallas.triton's GPU-info query), so it is a
developer's check, not a test.

    .venv312/bin/python scripts/lower_check.py jaxk3.kernels.moe_experts:experts_routed tests.test_kernels:_routed_real 64

The second argument names a case builder returning (cfg, *args, shared) as tests/test_kernels.py's
`_routed_real` does; the rest are its integer arguments.
"""
from __future__ import annotations

import importlib
import os
import sys
import types

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))

import jax  # noqa: E402


def abstract_sm90() -> None:
    """Answer pallas.triton's GPU query with compute capability 9.0 (an H200's) instead of failing on the CPU."""
    from jax._src.pallas.triton import pallas_call_registration as R

    R.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability="9.0")


def lower(fn, *args, **kw) -> int:
    """Export `fn(*args, **kw)` for CUDA; the number of Triton custom calls in the module."""
    f = jax.jit(lambda *a: fn(*a, **kw))
    e = jax.export.export(f, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    return e.mlir_module().count("xla.gpu.triton")


def _resolve(spec: str):
    mod, name = spec.split(":")
    return getattr(importlib.import_module(mod), name)


if __name__ == "__main__":
    abstract_sm90()
    fn, case = _resolve(sys.argv[1]), _resolve(sys.argv[2])
    cfg, *args, shared = case(*map(int, sys.argv[3:]))
    print(f"{sys.argv[1]}: {lower(lambda *a: fn(cfg, *a, shared=shared), *args)} Triton kernels lowered")
