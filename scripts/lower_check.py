"""A kernel lowered to Triton IR for an sm_90 on the CPU (jaxk3.tools.triton_lowering), before its GPU call:

    .venv312/bin/python scripts/lower_check.py jaxk3.kernels.moe_experts:experts_routed test_kernels:_routed_real 64

The second argument names a case builder (a module under tests/ or importable) returning (cfg, *args, shared) as
tests/test_kernels.py's `_routed_real` does; the rest are its integer arguments.  tests/test_kernels_lowering.py
lowers the kernels at the presets' real dims in the test suite.
"""
from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))

from jaxk3.tools.triton_lowering import lower  # noqa: E402


def _resolve(spec: str):
    mod, name = spec.split(":")
    return getattr(importlib.import_module(mod), name)


if __name__ == "__main__":
    fn, case = _resolve(sys.argv[1]), _resolve(sys.argv[2])
    cfg, *args, shared = case(*map(int, sys.argv[3:]))
    print(f"{sys.argv[1]}: {lower(lambda *a: fn(cfg, *a, shared=shared), *args)} Triton kernels lowered")
