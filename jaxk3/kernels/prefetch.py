"""The next GEMV's weights pulled into L2 by extra programs of a latency-bound kernel before it (decode).

Some decode kernels take several microseconds while reading little from memory (`kda_decode_in`: ~7 us for ~4 MB
of state on an H200; the MLA attention at 4K: ~7 us for ~5 MB), and the GEMV after each streams ~19 MB of weights
(o_proj) at 2.3 TB/s, short of the copy bandwidth by its ramp.  Here the first kernel gets `slots` more programs
that only read the GEMV's weight, a share each, so that memory works while the kernel's own programs wait on their
dependent loads, and the GEMV finds its weight in L2 (60 MB on an H200).  Nothing is computed from those loads:
each extra program writes its share's sum to a small output the caller drops (the loads must feed a store, or the
compiler removes them).

A kernel takes it by growing its grid's last axis and wrapping its body (`extend`, `wrap`): for a grid (B, M, J)
the programs (0, m, J + x), x < X, touch slot m·X + x of the M·X slots; rows b > 0 of the extra programs do
nothing.  The weight is read through a [rows, ROW] view of its elements (a reshape: no copy), in tiles of TILE
rows, UNROLL tiles in flight per loop step.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
ROW = 512  # elements per row of the view
TILE = 8  # rows per load (8 KB of bf16)
UNROLL = 4  # loads in flight per program


@dataclasses.dataclass(frozen=True)
class Plan:
    """`slots` programs each read `rows` rows of the weight's [slots·rows, ROW] view."""
    slots: int
    rows: int

    @property
    def steps(self) -> int:  # loop steps of UNROLL tiles (rows is a multiple of TILE·UNROLL)
        return self.rows // (TILE * UNROLL)


def plan(w: jax.Array | jax.ShapeDtypeStruct, per: int, wanted: int) -> Plan | None:
    """The plan for about `wanted` slots in groups of `per` (the kernel's grid rows that can take extra programs):
    slots = per·X for the smallest X with per·X >= wanted whose share is whole loop steps; None where no X up to
    4·wanted/per divides the weight (or wanted is 0): the kernel then runs as it is."""
    n = 1
    for d in w.shape:
        n *= d
    if wanted <= 0 or per <= 0 or n % ROW:
        return None
    rows = n // ROW
    for x in range(max(1, -(-wanted // per)), 4 * max(1, -(-wanted // per)) + 1):
        s = per * x
        if rows % s == 0 and (rows // s) % (TILE * UNROLL) == 0:
            return Plan(s, rows // s)
    return None


def view(w: jax.Array, p: Plan) -> jax.Array:
    """w's elements as [slots·rows, ROW] (a reshape of a contiguous array: no copy)."""
    return w.reshape(p.slots * p.rows, ROW)


def extend(grid: tuple[int, int, int], p: Plan) -> tuple[int, int, int]:
    """A (B, M, J) grid with X = slots / M more programs along its last axis."""
    B, M, J = grid
    return B, M, J + p.slots // M


def _touch(w_ref, out_ref, slot, p: Plan) -> None:
    """Read rows [slot·rows, (slot+1)·rows) of w_ref, UNROLL tiles per loop step, and write their fp32 sum."""
    from jax.experimental import pallas as pl

    base = slot * p.rows

    def body(i, acc):
        start = base + i * (TILE * UNROLL)
        tiles = [w_ref[pl.ds(pl.multiple_of(start + t * TILE, TILE), TILE), :] for t in range(UNROLL)]
        return acc + sum(jnp.sum(t.astype(F32), axis=0) for t in tiles)
    acc = jax.lax.fori_loop(0, p.steps, body, jnp.zeros((ROW,), F32))
    out_ref[slot] = jnp.sum(acc)


def wrap(kernel, n_in: int, grid: tuple[int, int, int], p: Plan):
    """`kernel` (refs: n_in inputs, then outputs) of a (B, M, J) grid, for `extend(grid, p)`: the programs j < J run
    it; the extra ones read their slot of the weight, which comes after the n_in inputs, and write to the last
    output.  The kernel gets its program ids as `ids=(b, m, j)` (interpret mode cannot read program ids inside a
    branch)."""
    from jax.experimental import pallas as pl

    J, X = grid[2], p.slots // grid[1]

    @functools.wraps(kernel)
    def body(*refs):
        ins, w_ref, outs, out_ref = refs[:n_in], refs[n_in], refs[n_in + 1:-1], refs[-1]
        b, m, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

        @pl.when(j < J)
        def _():
            kernel(*ins, *outs, ids=(b, m, j))

        @pl.when((j >= J) & (b == 0))
        def _():
            _touch(w_ref, out_ref, m * X + (j - J), p)
    return body


def out_shape(p: Plan) -> jax.ShapeDtypeStruct:
    """The extra output: one fp32 sum per slot (the caller drops it)."""
    return jax.ShapeDtypeStruct((p.slots,), F32)


def reference(w: jax.Array, p: Plan) -> jax.Array:
    """What the extra programs write: each slot's share of the weight summed in fp32 (the tests' oracle)."""
    return jnp.sum(view(w, p).astype(F32).reshape(p.slots, -1), axis=1)
