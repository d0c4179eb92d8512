"""``gather_logits``: vocab-parallel logits ``[..., V_pad/tp]`` to ``[..., vocab_size]``."""
from __future__ import annotations

import jax.numpy as jnp

from jaxk3.collectives.padded import padded_all_gather


def gather_logits(local_logits, axis_name, vocab_size: int, impl: str = "auto"):
    """Gathers vocab-parallel logits ``[..., V_pad/tp]`` into ``[..., vocab_size]``.

    Shards are concatenated along the last axis in rank order, then the padding is sliced off.
    Works for any number of leading rows (T > 1 falls back to lax when prefill-sized)."""
    local_logits = jnp.asarray(local_logits)
    if local_logits.ndim < 1:
        raise ValueError("gather_logits needs logits of rank >= 1 ([..., V_pad/tp])")
    full = padded_all_gather(local_logits, axis_name, axis=-1, tiled=True, impl=impl)
    if vocab_size > full.shape[-1]:
        raise ValueError(f"vocab_size {vocab_size} > gathered vocab {full.shape[-1]}")
    return full[..., :vocab_size]
