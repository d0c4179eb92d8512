"""Helpers the collectives' tests share (no tests here): random inputs, bit views, poisoned
outputs."""
from __future__ import annotations

import numpy as np
import pytest

from jaxk3 import collectives as C


@pytest.fixture(autouse=True)
def poison_outputs():
    """The handlers fill their outputs with 0xA5 first: a byte a collective fails to write shows up
    in a bitwise comparison.  Autouse in every module that imports it."""
    ext = C.extension()
    if ext is None:
        yield
        return
    ext._set_poison_outputs(True)
    yield
    ext._set_poison_outputs(False)


def random_array(seed: int, shape, dtype) -> np.ndarray:
    """Random data of any dtype (integers over their whole range), no zeros (bool: random bits).
    NumPy, so no compile per shape and dtype."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
        return np.where(x == 0, 1, x).astype(dtype)
    x = rng.standard_normal(shape).astype(np.float32) * 3
    return np.where(x == 0, 1.0, x).astype(dtype)


def bits(a) -> np.ndarray:
    """The bytes of an array, for bitwise comparisons (bool as 0/1 bytes)."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.uint8) if a.dtype != np.bool_ else a.astype(np.uint8)
