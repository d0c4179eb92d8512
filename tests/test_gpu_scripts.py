"""The GPU research scripts' own kernels, checked on the CPU before a GPU call spends device time on them:
scripts/gpu/mxfp4_decode.py's forms of one MXFP4 GEMV (interpret mode against a float64 product of the dequantised
matrix, and the conversion-free ones lowered to Triton IR for an sm_90 at the K3 experts' input width).  The
experts kernel's "magic" decode itself is tested in tests/test_kernels.py."""
from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "gpu" / "mxfp4_decode.py"


def _script():
    import sys

    sys.path.insert(0, str(SCRIPT.parent))  # its `timing` helper
    spec = importlib.util.spec_from_file_location("mxfp4_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("form", ["f16", "select", "magic", "half", "bf16"])
def test_mxfp4_decode_forms_match_the_float64_product(form):
    """Interpret mode at [64, 512] (every code drawn, scales 2^-8 .. 2^-5): the float32 forms within 1e-6 of max|ref|
    (exact products, 512 float32 terms summed in another order: ~1e-7); `half` within 2e-3: each float16 sum of 8
    products rounds at 2^-11 of its size, and a row's 16 groups of 4 such sums add up in float32 (measured 3.5e-4)."""
    m = _script()
    packed, scale, x = m.case(64, 512)
    ref = m.reference(packed, scale, x)
    f, ops, nbytes = m.build(form, packed, scale, bn=16, bk=128, interpret=True)
    y = np.asarray(jax.jit(f)(ops, x), np.float64)
    err = np.max(np.abs(y - ref)) / np.max(np.abs(ref))
    assert err <= (2e-3 if form == "half" else 1e-6), err
    assert nbytes == (64 * 512 * 2 if form == "bf16" else 64 * 256 + 64 * 16)


@pytest.mark.parametrize("form", ["magic", "half"])
def test_mxfp4_decode_forms_lower_for_sm90(form):
    """The new decodes lowered to Triton IR for an sm_90 at the K3 experts' 7168-wide input, 256-column tiles."""
    from jaxk3.tools.triton_lowering import lower

    m = _script()
    packed, scale, x = m.case(64, 7168)
    f, ops, _ = m.build(form, packed, scale, bn=16, bk=256)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), ops)
    assert lower(f, shapes, jax.ShapeDtypeStruct(x.shape, x.dtype)) == 1
