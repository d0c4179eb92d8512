"""Placeholder: lax-only version of the public API (replaced by the FFI version)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def all_gather(x, axis_name, *, axis=0, tiled=False, impl="auto"):
    return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


def padded_all_gather(x, axis_name, *, axis=-1, tiled=True, impl="auto"):
    return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


def gather_logits(local_logits, axis_name, vocab_size, impl="auto"):
    full = lax.all_gather(local_logits, axis_name, axis=local_logits.ndim - 1, tiled=True)
    return full[..., :vocab_size]
