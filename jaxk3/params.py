"""Weights declared once: a `Param` per weight, and everything else derived from it.

Each block file declares its weights in one function, `abstract(cfg, ...)`, which returns the
block's weights dataclass with a `Param` in every field (docs/ARCHITECTURE.md, "How to add a
weight").  A `Param` is a pytree leaf, so the abstract tree has the structure of the real one, and
these functions derive from it:

    partition_specs   the PartitionSpec of every weight (the sharding table)
    checkpoint_shapes every checkpoint tensor the model reads: name -> shape
    random_checkpoint random host weights keyed by checkpoint name (tests, small models)
    random_on_devices random weights generated on the devices in their final sharding (benches)
    bytes_per_rank    bytes each rank reads per decode step, by group
    (checkpoint.py)   the load plan: which tensor, which slice, which transform

`Param.source` says how the model's array relates to its checkpoint tensor:

    plain     the same array
    pad_rows  the vocab tables: checkpoint [V, D], model [V_pad, D] with zero rows past V
    a_log     checkpoint [H], [N >= H] (first H used) or [1, 1, H, 1]; model [H]
    experts   model [E, *ckpt_shape] stacked from one tensor per expert (`{e}` in the name).  With
              experts_format "dense" an MXFP4 checkpoint's experts (weight_packed + weight_scale)
              are dequantised at load; with "mxfp4" the packed bytes and the scales are two uint8
              Params of their own (jaxk3.kernels.moe_experts.MXFP4), read as they are
"""
from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxk3.sharding import COL, LATENT, LATENT_ROW, REP, ROW, TP  # noqa: F401  (re-exported for the block files)
SOURCES = ("plain", "pad_rows", "a_log", "experts")
INITS = ("w", "norm", "a_log", "dt", "bias", "conv", "embed", "head", "res", "e2m1", "e8m0")
DTYPES = ("compute", "fp32", "uint8")


@dataclasses.dataclass(frozen=True)
class Param:
    """One weight: its shape in the model, its checkpoint names, sharding, dtype class and init.

    names: checkpoint tensor names, the hub spelling first, then accepted alternates (e.g. what
    transformers' `save_pretrained` writes); experts carry `{e}`.  spec: a PartitionSpec over the
    mesh axes, or LATENT.  dtype: "compute" (the model's dtype) or "fp32".  group: the part of the
    step it belongs to, for byte accounting (kda, mla_latent, mla_other, moe_experts, moe_latent, moe_other, mlp,
    mlp_and_shared_experts, embed, lm_head, other).
    """
    shape: tuple[int, ...]
    names: tuple[str, ...]
    spec: Any = REP
    dtype: str = "compute"
    init: str = "w"
    group: str = "other"
    source: str = "plain"
    ckpt_shape: tuple[int, ...] | None = None  # when it differs from `shape` (see the module docstring)

    def __post_init__(self):
        if self.source not in SOURCES or self.init not in INITS or self.dtype not in DTYPES:
            raise ValueError(f"Param {self.names[0]}: bad source/init/dtype {self.source}/{self.init}/{self.dtype}")

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        return self.ckpt_shape if self.ckpt_shape is not None else self.shape

    def pspec(self, shard_latent: bool = True) -> P:
        if self.spec == LATENT:
            return COL if shard_latent else REP
        if self.spec == LATENT_ROW:
            return ROW if shard_latent else REP
        return self.spec

    def np_dtype(self, compute) -> np.dtype:
        return np.dtype({"fp32": np.float32, "uint8": np.uint8}.get(self.dtype, compute))


def weight(shape, prefixes: str | tuple[str, ...], field: str, **kw) -> Param:
    """A Param named `<prefix><field>.weight` for each prefix (the first is the hub spelling)."""
    prefixes = (prefixes,) if isinstance(prefixes, str) else tuple(prefixes)
    suffix = field if field in ("A_log", "dt_bias") or field.endswith("e_score_correction_bias") else f"{field}.weight"
    return Param(tuple(int(s) for s in shape), tuple(p + suffix for p in prefixes), **kw)


def is_param(x) -> bool:
    return isinstance(x, Param)


def params(tree) -> list[Param]:
    return jax.tree.leaves(tree, is_leaf=is_param)


def partition_specs(tree, shard_latent: bool = True):
    """The PartitionSpec tree of an abstract (Param) tree."""
    return jax.tree.map(lambda p: p.pspec(shard_latent), tree, is_leaf=is_param)


def expert_names(p: Param, num: int) -> list[str]:
    return [p.name.format(e=e) for e in range(num)]


def _checkpoint_tensors(tree):
    """(name, checkpoint shape, init) of every checkpoint tensor, hub spelling, each name once (a tied
    lm_head names the embedding as its source; experts expand to one tensor per expert)."""
    seen = set()
    for p in params(tree):
        for n in (expert_names(p, p.shape[0]) if p.source == "experts" else [p.name]):
            if n not in seen:
                seen.add(n)
                yield n, p.checkpoint_shape, p.init


def checkpoint_shapes(tree) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the abstract tree reads (hub spelling): name -> shape."""
    return {n: shape for n, shape, _ in _checkpoint_tensors(tree)}


_SCALES = {"norm": (0.1, 1.0), "dt": (1.0, 0.0), "bias": (0.1, 0.0), "conv": (0.3, 0.0), "embed": (1.0, 0.0),
           "res": (0.1, 0.0), "w": (0.02, 0.0)}


def _scale(kind: str, hidden: int) -> tuple[float, float]:
    return (hidden ** -0.5, 0.0) if kind == "head" else _SCALES[kind]


# MXFP4 random init: uniform nibbles (E2M1 values have RMS 2.93) times scales 2**-8 .. 2**-6, an
# RMS of about 0.02 like the dense "w" init; the upper bound is exclusive.
E8M0_RANGE = {"e8m0": (119, 122)}


def random_checkpoint(tree, hidden: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights keyed by checkpoint name (float32; uint8 for MXFP4 bytes), one generator per
    name (seed, crc32(name)), so a tensor's values do not depend on which other tensors exist."""
    out = {}
    for name, shape, kind in _checkpoint_tensors(tree):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if kind in E8M0_RANGE or kind == "e2m1":
            out[name] = rng.integers(*E8M0_RANGE.get(kind, (0, 256)), shape).astype(np.uint8)
            continue
        if kind == "a_log":
            a = np.log(rng.uniform(1.0, 16.0, shape))
        else:
            s, b = _scale(kind, hidden)
            a = rng.standard_normal(shape) * s + b
        out[name] = a.astype(np.float32)
    return out


def random_on_devices(tree, mesh, dtype, hidden: int, shard_latent: bool = True, seed: int = 0):
    """Random weights generated on the devices in their final sharding (no host copy: real sizes).
    The generator is the "unsafe_rbg" PRNG (the device's own bits generator: many times faster than
    threefry at the ~100 GB of a real-size model; statistical quality is not the point of bench weights)."""
    root = jax.random.key(seed, impl="unsafe_rbg")

    def make(p: Param):
        dt = p.np_dtype(dtype)
        sharding = NamedSharding(mesh, p.pspec(shard_latent))
        return _device_generator(p.shape, dt.name, p.init, sharding, hidden)(
            jax.random.fold_in(root, zlib.crc32(p.name.encode()) & 0x7FFFFFFF))

    return jax.tree.map(make, tree, is_leaf=is_param)


def abstract_on(tree, mesh, dtype, shard_latent: bool = True):
    """`random_on_devices`' arrays as jax.ShapeDtypeStructs (shape, dtype, NamedSharding): the arguments of a
    compile for devices this process does not drive (`jaxk3.tools.aot`)."""
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.np_dtype(dtype),
                                                       sharding=NamedSharding(mesh, p.pspec(shard_latent))),
                        tree, is_leaf=is_param)


@functools.lru_cache(maxsize=None)
def _device_generator(shape, dtype: str, kind: str, sharding, hidden: int):
    def gen(k):
        if kind == "e2m1":
            return jax.random.bits(k, shape, jnp.uint8)
        if kind in E8M0_RANGE:
            return jax.random.randint(k, shape, *E8M0_RANGE[kind], jnp.int32).astype(jnp.uint8)
        if kind == "a_log":
            return jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
        s, b = _scale(kind, hidden)
        return (jax.random.normal(k, shape, jnp.float32) * s + b).astype(dtype)

    return jax.jit(gen, out_shardings=sharding)


def shard_bytes(a: jax.Array) -> int:
    return math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize


def bytes_per_rank(tree, weights, *, experts_touched: float, rows: int) -> dict[str, int]:
    """Bytes one rank reads per decode step, by Param.group: the largest shard of every weight
    (replicated ones in full); stacked experts only for the `experts_touched` a step can select;
    the embedding only for its `rows` looked-up rows."""
    out: dict[str, int] = {}

    def count(p: Param, a: jax.Array):
        b = shard_bytes(a)
        if p.source == "experts":
            b = int(b * min(experts_touched, p.shape[0]) / p.shape[0])
        elif p.group == "embed":
            b = min(rows, a.shape[0]) * a.sharding.shard_shape(a.shape)[1] * a.dtype.itemsize
        out[p.group] = out.get(p.group, 0) + b
        return p

    jax.tree.map(count, tree, weights, is_leaf=is_param)
    return out


def matmul_elements(tree, arrays=None, *, expert_fraction: float) -> tuple[float, float]:
    """(the weight elements one token multiplies in the matmuls, the lm_head's), per rank: every Param
    of two or more dims but the embedding (a lookup), the routed experts at `expert_fraction` (k of E:
    the token's own), MXFP4 codes at two per byte (their scales are not multiplied).  `arrays`: the
    per-rank arrays beside `tree` (their shard shapes), else the declared shapes (the whole model)."""
    tok = head = 0.0

    def count(p: Param, a=None):
        nonlocal tok, head
        if len(p.shape) < 2 or p.group == "embed" or p.init == "e8m0":
            return p
        n = float(math.prod(a.sharding.shard_shape(a.shape))) if a is not None else float(math.prod(p.shape))
        n *= 2 if p.init == "e2m1" else 1
        if p.source == "experts":
            n *= expert_fraction
        if p.group == "lm_head":
            head += n
        else:
            tok += n
        return p

    if arrays is None:
        jax.tree.map(count, tree, is_leaf=is_param)
    else:
        jax.tree.map(count, tree, arrays, is_leaf=is_param)
    return tok, head


def declared_bytes(tree, compute_bytes: int, skip: tuple[str, ...] = ()) -> int:
    """Bytes of every declared weight at its declared shape (the whole model; `compute_bytes` per
    element of the "compute" dtype class), but those of the groups in `skip`."""
    size = {"compute": compute_bytes, "fp32": 4, "uint8": 1}
    return sum(math.prod(p.shape) * size[p.dtype] for p in jax.tree.leaves(tree, is_leaf=is_param)
               if p.group not in skip)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One per-row decode-state array (a cache), declared by its block: global shape with the batch
    first, dtype class ("compute" | "fp32" | "int32"), and which dimension TP splits (None: replicated)."""
    shape: tuple[int, ...]
    dtype: str = "compute"
    tp_dim: int | None = None

    def pspec(self, dp_axis: str | None) -> P:
        dims: list = [None] * len(self.shape)
        dims[0] = dp_axis
        if self.tp_dim is not None:
            dims[self.tp_dim] = TP
        while dims and dims[-1] is None:
            dims.pop()
        return P(*dims)

    def np_dtype(self, compute) -> np.dtype:
        return np.dtype({"fp32": np.float32, "int32": np.int32}.get(self.dtype, compute))


def is_buffer(x) -> bool:
    return isinstance(x, Buffer)


def buffer_specs(tree, dp_axis: str | None):
    return jax.tree.map(lambda b: b.pspec(dp_axis), tree, is_leaf=is_buffer)


# ----------------------------------------------------------------------------- serving layout
@dataclasses.dataclass(frozen=True)
class Fuse:
    """A serving-layout weight made at load from weights one block declares (docs/ARCHITECTURE.md,
    "Serving layout"): `members` (field names, in order) joined into the block's field `field`.

    how "rows": each rank's local slices of the members, concatenated along their output rows, so
        one GEMV of the block's input computes every member's output (a member that is replicated
        contributes all its rows to every rank's block); the global array is [tp * rows, In] split
        by rows over "tp".  With `axis` 1 (stacked experts [E, O, In], members of one spec) the
        joined axis is the members' sharded one, and the spec is theirs.
    how "stack": members of one local shape stacked on a new leading axis ([n, *local]), for
        projections of different inputs that one batched product serves.

    The checkpoint keeps the members' names (one `Param` each: loading, byte counts and the
    sharding table are unchanged); a block class lists its Fuses in a class attribute `FUSE`, and
    a Fuse applies to a block when all its members are present and its field is still empty (the
    first that applies fills the field)."""
    field: str
    members: tuple[str, ...]
    how: str = "rows"
    axis: int = 0  # "rows": the axis the local slices are joined along (1: a stack of experts' [E, O, In])


def _fuses(node) -> tuple[Fuse, ...]:
    return getattr(type(node), "FUSE", ()) if dataclasses.is_dataclass(node) and not isinstance(node, type) else ()


def serve(tree, combine):
    """`tree` with every block's applicable Fuses applied: `combine(fuse, [member values])` makes the
    field's value and the members become None.  Works on any tree of block dataclasses (placed arrays,
    PartitionSpecs, host arrays), the members' values as they are in it."""
    if isinstance(tree, (list, tuple)) and not isinstance(tree, P) and not hasattr(tree, "_fields"):
        return type(tree)(serve(t, combine) for t in tree)
    if not dataclasses.is_dataclass(tree) or isinstance(tree, type) or is_param(tree) or is_buffer(tree):
        return tree
    out = {f.name: serve(getattr(tree, f.name), combine) for f in dataclasses.fields(tree)}
    for fz in _fuses(tree):
        if out.get(fz.field) is None and all(out.get(m) is not None for m in fz.members):
            out[fz.field] = combine(fz, [out[m] for m in fz.members])
            out.update({m: None for m in fz.members})
    return dataclasses.replace(tree, **out)


def served_spec(fz: Fuse, specs: list) -> P:
    """The PartitionSpec of a fused weight from its members' (resolved) specs."""
    if fz.how == "stack":
        return P(None, *specs[0])
    if fz.axis:
        if len({tuple(s) for s in specs}) != 1:
            raise ValueError(f"Fuse {fz.field}: members along axis {fz.axis} need one spec, got {specs}")
        return specs[0]
    return P(TP, None) if any(TP in tuple(s) for s in specs) else P()


def _fieldwise(combine):
    """`combine(fuse, members)` applied field by field where the members are dataclasses (a weight of several
    arrays, MXFP4: packed, scale), as it is to plain leaves."""
    def each(fz: Fuse, members: list):
        if dataclasses.is_dataclass(members[0]):  # a static field (MXFP4.f16: a property of every value) holds for
            # the join where it holds for every member
            return dataclasses.replace(members[0], **{
                f.name: all(getattr(m, f.name) for m in members) if f.metadata.get("static") else
                each(fz, [getattr(m, f.name) for m in members]) for f in dataclasses.fields(members[0])})
        return combine(fz, members)
    return each


def _join_local(fz: Fuse, arrays) -> jax.Array:
    """One rank's join of a Fuse's member arrays: concatenated along `fz.axis` ("rows") or stacked."""
    return jnp.concatenate(arrays, axis=fz.axis) if fz.how == "rows" else jnp.stack(arrays, 0)


def serve_specs(spec_tree):
    """The serving layout's PartitionSpecs (`partition_specs(...)` of the checkpoint layout, fused)."""
    return serve(spec_tree, _fieldwise(served_spec))


def serve_local(tree):
    """A tree of one rank's (unplaced or single-device) arrays in the serving layout: each Fuse's members
    joined as `serve_arrays` joins each rank's slices (kernel tests and benches of one block)."""
    return serve(tree, _fieldwise(_join_local))


def serve_arrays(weights, mesh, donate: bool = False):
    """Placed weights in the serving layout: each Fuse's members joined per rank on the devices (each
    member's PartitionSpec read from its NamedSharding), and the members dropped.  The joined array
    is made under shard_map, so every rank joins its own slices.  `donate`: each member is deleted once
    its join has run, so the peak memory is the weights plus one fused array, not twice the fused
    members (Kimi-Linear-48B's w1|w3 alone are 63 GB; seen on an H200: jit donation does not free them,
    since XLA cannot alias them to the larger output)."""
    from jaxk3._compat import call_shard_map

    def join(fz: Fuse, arrays: list):
        specs = [_spec_of(a) for a in arrays]
        f = call_shard_map(lambda *xs: _join_local(fz, xs), mesh=mesh, in_specs=tuple(specs),
                           out_specs=served_spec(fz, specs), check_vma=False)
        out = jax.jit(f)(*arrays)
        if donate:  # free the members now (XLA cannot reuse them for the larger output: donation would not)
            out.block_until_ready()
            for a in arrays:
                a.delete()
        return out

    return serve(weights, _fieldwise(join))


def serve_abstract(weights):
    """`serve_arrays` on abstract weights (jax.ShapeDtypeStruct leaves with a NamedSharding, as a compile for
    another machine takes them: `jaxk3.tools.aot`): each Fuse's joined shape and sharding, nothing computed.  A
    rank's joined slice is its members' local slices joined (`_join_local`), and the global shape that slice
    times the TP size along the joined spec's sharded dimension."""
    def join(fz: Fuse, members: list):
        specs = [_spec_of(m) for m in members]
        spec, mesh = served_spec(fz, specs), members[0].sharding.mesh
        local = [m.sharding.shard_shape(m.shape) for m in members]
        if fz.how == "rows":
            shape = list(local[0])
            shape[fz.axis] = sum(l[fz.axis] for l in local)
        else:
            shape = [len(local), *local[0]]
        shape = [d * (mesh.shape[TP] if i < len(spec) and spec[i] == TP else 1) for i, d in enumerate(shape)]
        return jax.ShapeDtypeStruct(tuple(shape), members[0].dtype, sharding=NamedSharding(mesh, spec))

    return serve(weights, _fieldwise(join))


def _spec_of(a: jax.Array) -> P:
    sh = a.sharding
    spec = getattr(sh, "spec", None)
    if spec is None:
        raise ValueError(f"serve_arrays: a weight of shape {a.shape} is not placed with a NamedSharding ({sh})")
    return spec


def serve_host(weights):
    """Host (NumPy) weights of one rank (TP 1) in the serving layout: members concatenated or stacked."""
    return serve(weights, lambda fz, xs: np.concatenate(xs, fz.axis) if fz.how == "rows" else np.stack(xs, 0))
