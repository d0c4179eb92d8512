"""MXFP4 (OCP microscaling FP4) dequantisation, as compressed-tensors `mxfp4-pack-quantized` stores it.

A quantised linear weight W [m, n] is stored as two uint8 tensors:

    weight_packed  [m, n/2]   two E2M1 codes per byte: LOW nibble = column 2j, HIGH nibble = column 2j+1
    weight_scale   [m, n/32]  one E8M0 exponent per group of 32 consecutive columns, bias 127

    W[i, j] = e2m1(code[i, j]) * 2**(scale[i, j // 32] - 127)

E2M1 code bits `s e e m`: bit 3 is the sign, bits 0..2 index the magnitudes
{0, 0.5, 1, 1.5, 2, 3, 4, 6}.  Scale 255 is NaN in the OCP MX spec (E8M0 has no infinity).

The nibble order and the scale bias are not assumed: tests/test_checkpoint.py compares `dequantize`
bit for bit with compressed-tensors' own `MXFP4PackedCompressor.decompress` on random bytes.
"""
from __future__ import annotations

import numpy as np

from jaxk3.config import MXFP4_GROUP as GROUP
SCALE_BIAS = 127
SCALE_NAN = 255  # the E8M0 code for NaN (the OCP MX spec; E8M0 has no infinity)
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
#: all 16 codes, sign bit 3 included
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., k] -> float32 [..., 2k]: the low nibble of byte j is element 2j, the high one 2j+1."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise ValueError(f"mxfp4: weight_packed must be uint8, got {packed.dtype}")
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))
    return E2M1_VALUES[codes]


def scales(scale_u8: np.ndarray) -> np.ndarray:
    """E8M0 uint8 -> float32 2**(s - 127) (exact; 255 -> NaN)."""
    s = np.asarray(scale_u8)
    if s.dtype != np.uint8:
        raise ValueError(f"mxfp4: weight_scale must be uint8, got {s.dtype}")
    with np.errstate(over="ignore"):  # 2**128 (scale 255) overflows; it is NaN below
        out = np.ldexp(np.float32(1.0), s.astype(np.int32) - SCALE_BIAS).astype(np.float32)
    out[s == 255] = np.nan
    return out


def dequantize(packed: np.ndarray, scale_u8: np.ndarray, dtype=np.float32, col_offset: int = 0) -> np.ndarray:
    """Dense [m, 2k] weights from `weight_packed` [m, k] and the scale columns that cover them.

    `col_offset` is the first unpacked column's index within its scale group (for a column slice of a
    tensor that does not start on a group boundary): element j uses scale column
    `(col_offset + j) // 32`.  Products are exact in float32 (3 significant bits times a power of 2)
    and then rounded to `dtype` once.
    """
    vals = unpack_e2m1(packed)
    n = vals.shape[-1]
    sc = scales(scale_u8)
    idx = (col_offset + np.arange(n)) // GROUP
    if idx.size and idx[-1] >= sc.shape[-1]:
        raise ValueError(f"mxfp4: {sc.shape[-1]} scale columns do not cover {n} values (offset {col_offset})")
    with np.errstate(over="ignore", invalid="ignore"):  # 6 * 2**127 is inf, as in compressed-tensors
        return (vals * sc[..., idx]).astype(dtype)
