"""The lowering rule every jaxk3 collective primitive shares: plan again with the devices the
lowering context knows (the shard_map body's mesh), then emit the FFI custom call, or lax's own
lowering of the same collective when the plan says lax.

Every emitted custom call gets a fresh ``site`` id (diagnostics); the CPU handlers match ranks
by the custom-call instance XLA makes of it (ffi/call_instance.h), so a call lowered once and
inlined several times (a nested jax.jit) is safe on every device order.
"""
from __future__ import annotations

import collections
import itertools
from typing import Callable

import jax
import numpy as np
from jax.interpreters import mlir

from jaxk3.collectives import context
from jaxk3.collectives.base import GatherUnavailableError, Plan
from jaxk3.collectives.planning import plan

_site_ids = itertools.count(1)

# FFI custom calls emitted so far, by target: diagnostics (scripts/jax_dropin_tests.sh counts the
# tests of JAX's own suite that take the FFI path with it).
emitted: collections.Counter = collections.Counter()


def ffi_attributes(p: Plan) -> dict:
    """The four attributes every jaxk3 custom call carries (ffi/common.h: GroupAttrs)."""
    return dict(
        site=np.int64(next(_site_ids)),
        group_size=np.int64(p.group_size),
        table=np.asarray(p.table, dtype=np.int64),
        groups=np.asarray(p.groups, dtype=np.int64),
    )


def lower_collective(ctx, x, *, op: str, names: tuple, padded: bool, strict: bool,
                     emit: Callable[[jax.Array, Plan], jax.Array], fallback: Callable[[jax.Array], jax.Array]):
    """Lowers one collective: `emit(x, plan)` builds the FFI path, `fallback(x)` lax's."""
    aval = ctx.avals_in[0]
    where = context.where_lowered(ctx)
    if isinstance(where, str):
        p = Plan("lax", where)
    else:
        p = plan(aval.shape, aval.dtype, names, padded=padded, impl="ffi", op=op, where=where)
    if p.path != "ffi":
        if strict:
            raise GatherUnavailableError(f"impl='ffi' but the FFI {op} does not apply: {p.reason}")
        return mlir.lower_fun(fallback, multiple_results=False)(ctx, x)
    emitted[p.target] += 1
    return mlir.lower_fun(lambda v: emit(v, p), multiple_results=False)(ctx, x)
