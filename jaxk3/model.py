"""The model: its weight and cache trees and the TP forward (the decode step and the prefill).

One decode step, per rank inside one `shard_map` over the "tp" axis (docs/SPEC.md §3, §4):

    x = embed(tok)                                          vocab-parallel, summed over TP
    for each layer l:
        h = residual stream → attention input (K3: AttnRes mix; Kimi-Linear: the residual)
        a, cache_l = attention_block(RMSNorm(h))            KDA | MLA
        h = residual stream + a → FFN input
        f = ffn_block(RMSNorm(h))                           MLP | MoE
    logits = lm_head(RMSNorm(final stream))                 vocab-parallel, gathered

Weights are declared once, per block (`abstract(cfg, prefix)` in each layers/ file; see
jaxk3.params); `abstract_weights(cfg, tp)` assembles the whole tree, and the sharding, the random
init, the checkpoint plan and the byte counts are derived from it.  Caches are declared the same
way (`cache_abstract`).  The user-facing `Model` (generate, score, step) is jaxk3.engine.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxk3 import collectives, params
from jaxk3.config import KimiK3Config
from jaxk3.layers import attn_res as res
from jaxk3.layers import embed as embed_lib
from jaxk3.layers import kda as kda_lib
from jaxk3.layers import mla as mla_lib
from jaxk3.layers import moe as moe_lib
from jaxk3.layers.common import TP, Normed
from jaxk3.layers.kda import KDACache, KDAWeights, kda_prefill, kda_step
from jaxk3.layers.mla import MLACache, MLAWeights, mla_prefill, mla_step
from jaxk3.layers.moe import MLPWeights, MoEWeights, mlp, moe
from jaxk3.kernels.attn_res_norm import mix_norm
from jaxk3.kernels.rms_norm import rms_norm
from jaxk3.params import REP, Buffer, weight
from jaxk3.sharding import DP, TP as TP_AXIS

IMPLS = ("auto", "ffi", "lax")  # collective implementations (jaxk3.collectives.IMPLS)

# The model's functions compile the arithmetic as written: every rounding to the compute dtype stays. XLA's
# default (`xla_allow_excess_precision`) lets its GPU compiler drop a bf16 round trip between two float32 values,
# so on a GPU the residual stream was carried in float32 across blocks where the model (and the CPU path, and the
# bf16 reference models) rounds it after each block. Off here (docs/PERF.md, twenty-first session): on the CPU
# the logits are bitwise as before; compiled for an H200, the 48B B = 1 step takes 262 launches instead of 281
# (each MoE block's residual add, a kernel of its own, goes into its consumers; 237 since the experts' kernel 2 adds
# it itself, moe_experts.RESIDUAL_IN_DOWN). `True` restores XLA's default.
EXCESS_PRECISION = False


def compiler_options() -> dict[str, Any]:
    """The `jax.jit(compiler_options=...)` of the step, the prefill and the decode loop (EXCESS_PRECISION)."""
    return {"xla_allow_excess_precision": bool(EXCESS_PRECISION)}


# ----------------------------------------------------------------------------- pytrees
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    """HF `model.layers.{l}.<field>.weight`; `attn` is `self_attn.*`, `ffn` is `mlp.*` / `block_sparse_moe.*`."""
    attn: KDAWeights | MLAWeights
    ffn: MLPWeights | MoEWeights
    input_layernorm: jax.Array  # [D]
    post_attention_layernorm: jax.Array  # [D]
    self_attention_res_norm: jax.Array | None = None  # [D]    AttnRes (K3)
    self_attention_res_proj: jax.Array | None = None  # [1, D]
    mlp_res_norm: jax.Array | None = None  # [D]
    mlp_res_proj: jax.Array | None = None  # [1, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    """Top level: `model.embed_tokens.weight`, `lm_head.weight` (both [V_pad, D]), `model.norm.weight`,
    `model.output_attn_res_{norm,proj}.weight` (K3), `model.layers.*`."""
    embed_tokens: jax.Array
    lm_head: jax.Array
    norm: jax.Array
    layers: tuple[LayerWeights, ...]
    output_attn_res_norm: jax.Array | None = None
    output_attn_res_proj: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    """Decode state of B rows: one cache per layer (`KDACache` or `MLACache`), and the tokens cached
    per row (`length [B] int32`, the next token's position)."""
    layers: tuple[KDACache | MLACache, ...]
    length: jax.Array


def abstract_layer(cfg: KimiK3Config, l: int) -> LayerWeights:
    """Layer `l`'s weights, from the blocks' declarations."""
    D, p = cfg.hidden_size, f"model.layers.{l}."
    attn = (kda_lib.abstract if cfg.layer_attn[l] == "kda" else mla_lib.abstract)(cfg, p + "self_attn.")
    if cfg.layer_ffn[l] == "mlp":  # transformers' save_pretrained writes it under block_sparse_moe.
        ffn = moe_lib.mlp_abstract((p + "mlp.", p + "block_sparse_moe."), D, cfg.intermediate_size, group="mlp")
    else:
        ffn = moe_lib.moe_abstract(cfg, p + "block_sparse_moe.")
    out = dict(input_layernorm=weight((D,), p, "input_layernorm", spec=REP, init="norm"),
               post_attention_layernorm=weight((D,), p, "post_attention_layernorm", spec=REP, init="norm"))
    if cfg.attn_res_block_size is not None:
        out["self_attention_res_norm"], out["self_attention_res_proj"] = res.abstract(D, p, "self_attention_res")
        out["mlp_res_norm"], out["mlp_res_proj"] = res.abstract(D, p, "mlp_res")
    return LayerWeights(attn=attn, ffn=ffn, **out)


def abstract_weights(cfg: KimiK3Config, tp: int = 1) -> Weights:
    """The whole model's weights as `Param`s (vocab tables padded for `tp`)."""
    emb, head = embed_lib.abstract(cfg, tp)
    top = {}
    if cfg.attn_res_block_size is not None:
        top["output_attn_res_norm"], top["output_attn_res_proj"] = res.abstract(
            cfg.hidden_size, "model.", "output_attn_res")
    return Weights(embed_tokens=emb, lm_head=head,
                   norm=weight((cfg.hidden_size,), "model.", "norm", spec=REP, init="norm"),
                   layers=tuple(abstract_layer(cfg, l) for l in range(cfg.num_hidden_layers)), **top)


def cache_abstract(cfg: KimiK3Config, batch: int, max_len: int) -> Cache:
    """Every cache array as a `Buffer` (shape, dtype class, TP dimension), from the blocks."""
    layers = tuple(kda_lib.cache_abstract(cfg, batch) if a == "kda" else mla_lib.cache_abstract(cfg, batch, max_len)
                   for a in cfg.layer_attn)
    return Cache(layers=layers, length=Buffer((batch,), "int32"))


def cache_specs(cfg: KimiK3Config, dp_axis: str | None = None) -> Cache:
    """PartitionSpecs of the cache (the batch split over `dp_axis` when the mesh has one)."""
    return params.buffer_specs(cache_abstract(cfg, 1, 1), dp_axis)


def checkpoint_shapes(cfg: KimiK3Config) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model reads (hub names): name -> shape."""
    return params.checkpoint_shapes(abstract_weights(cfg))


def random_hf_weights(cfg: KimiK3Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights keyed by checkpoint name (init per weight: docs/MODEL.md)."""
    return params.random_checkpoint(abstract_weights(cfg), cfg.hidden_size, seed)


# --------------------------------------------------------------------------- the step
@dataclasses.dataclass(frozen=True)
class StepOptions:
    tp_axis: str | None = TP_AXIS
    gather: str = "auto"  # collective implementations (jaxk3.collectives): auto | ffi | lax
    psum: str = "auto"
    shard_latent: bool = True
    kernels: str = "auto"  # device kernels (jaxk3.kernels): auto | off | on
    # Global index of w.layers[0] when the weights are a slice of a deeper K3 model (bench
    # decode): AttnRes then follows the global schedule, and the block snapshots completed
    # before the slice are stood in for by the embedding (same shapes, same work).
    layer_offset: int = 0
    # The weights' layout: False, the checkpoint's (one array per declared weight); True, the
    # serving layout (params.Fuse: same-input projections joined per rank, made at load by
    # `serve_weights`).  The step compiles for one of them.
    serving: bool = False

    @property
    def tp(self) -> TP | None:
        return None if self.tp_axis is None else TP(self.tp_axis, gather=self.gather, psum=self.psum,
                                                       kernels=self.kernels)


def attention_block(cfg: KimiK3Config, opt: StepOptions, l: int, w: KDAWeights | MLAWeights, xn: jax.Array,
                    cache: KDACache | MLACache, length_B: jax.Array, valid: jax.Array
                    ) -> tuple[jax.Array, KDACache | MLACache]:
    """Layer `l`'s attention on the normed input: (out fp32 summed over TP, the layer's new cache).
    One token per row (`xn` [B, D], `valid` [B]: decode) or T (`xn` [B, T, D], `valid` [B, T]: prefill)."""
    prefill = xn.ndim == 3
    if cfg.layer_attn[l] == "kda":
        fn = kda_prefill if prefill else kda_step
        out, conv, state = fn(cfg, w, xn, cache.conv, cache.state, valid, opt.tp, pos_B=length_B)
        return out, KDACache(conv=conv, state=state)
    fn = mla_prefill if prefill else mla_step
    out, kv = fn(cfg, w, xn, cache.kv, length_B, valid, opt.tp, opt.shard_latent)
    return out, MLACache(kv=kv)


def ffn_block(cfg: KimiK3Config, opt: StepOptions, l: int, w: MLPWeights | MoEWeights, xn_ND: jax.Array,
              many: bool = False, residual: jax.Array | None = None) -> jax.Array:
    """Layer `l`'s dense MLP or MoE on N normed tokens: out_ND fp32 summed over TP (`many`: the MoE's
    grouped-GEMM form, for prefill); with `residual` (a MoE layer at decode) the new residual stream bf16(residual +
    out) (jaxk3.layers.moe.moe adds it)."""
    if cfg.layer_ffn[l] == "mlp":
        if residual is not None:
            raise ValueError("ffn_block: the dense MLP does not add the residual (ffn_done does)")
        return mlp(cfg, w, xn_ND, opt.tp)
    return moe(cfg, w, xn_ND, opt.tp, grouped=many, residual=residual)


def _block_input(sources, res_norm, res_proj, ln_w, eps: float, dt, shape, decode: bool) -> jax.Array | Normed:
    """A block's normed input in the activation dtype: AttnRes over `sources` then RMSNorm
    (jaxk3.kernels.attn_res_norm's math; its Pallas kernel lost to XLA at every AttnRes preset on the
    H200 and was removed).  At decode without AttnRes (Kimi-Linear) the residual row and its norm
    weight as a `Normed`, which the block's first GEMVs norm in their prologue."""
    if decode and res_norm is None and len(sources) == 1 and sources[0].dtype == dt:
        return Normed(sources[0], ln_w, eps)
    return mix_norm(list(sources), res_norm, res_proj, ln_w, eps).astype(dt).reshape(shape)


def forward_local(cfg: KimiK3Config, opt: StepOptions, w: Weights, cache: Cache, tokens: jax.Array,
                  valid: jax.Array, all_logits: bool = True) -> tuple[jax.Array, Cache]:
    """One forward pass on one rank (inside shard_map, or on one device with tp_axis=None).

    Decode: `tokens`/`valid` [B], one token per row; returns (logits [B, vocab] fp32, new cache).
    Prefill: `tokens`/`valid` [B, T] (a row's invalid tokens first: left padding); returns logits
    [B, T, vocab] (`all_logits`) or those of the last position [B, vocab], and the new cache.
    Invalid tokens leave the caches alone.
    """
    prefill = tokens.ndim == 2
    B, T = tokens.shape[0], (tokens.shape[1] if prefill else 1)
    dt, eps, Bs = w.embed_tokens.dtype, cfg.rms_norm_eps, cfg.attn_res_block_size
    shape = (B, T, -1) if prefill else (B, -1)
    with jax.named_scope("embed"):
        st = res.stream_start(embed_lib.embed(tokens.reshape(-1), w.embed_tokens, opt.tp), Bs, opt.layer_offset)
    new_caches = []
    for l, lw in enumerate(w.layers):
        g = opt.layer_offset + l  # the layer's global index (AttnRes schedule)
        with jax.named_scope(f"layer{g}_{cfg.layer_attn[l]}"):
            srcs, st = res.attention_sources(st, g, Bs)
            xn = _block_input(srcs, lw.self_attention_res_norm, lw.self_attention_res_proj, lw.input_layernorm,
                              eps, dt, shape, not prefill)
            a, c = attention_block(cfg, opt, l, lw.attn, xn, cache.layers[l], cache.length, valid)
            new_caches.append(c)
        with jax.named_scope(f"layer{g}_{cfg.layer_ffn[l]}"):
            srcs, st = res.ffn_sources(st, a.reshape(B * T, -1), g, Bs)
            xn = _block_input(srcs, lw.mlp_res_norm, lw.mlp_res_proj, lw.post_attention_layernorm, eps, dt,
                              (B * T, -1), not prefill)
            if not prefill and Bs is None and cfg.layer_ffn[l] == "moe":  # Kimi-Linear decode: the MoE adds the
                # residual itself, the stream's add and rounding exactly
                st = res.Stream(p=ffn_block(cfg, opt, l, lw.ffn, xn, prefill, residual=st.p))
            else:
                st = res.ffn_done(st, ffn_block(cfg, opt, l, lw.ffn, xn, prefill), Bs)
    with jax.named_scope("head"):
        final = res.stream_final(st, Bs, w.output_attn_res_norm, w.output_attn_res_proj, eps)
        if prefill and not all_logits:
            final, shape = final.reshape(B, T, -1)[:, -1], (B, -1)
        logits = embed_lib.lm_head(rms_norm(final, w.norm, eps).astype(dt), w.lm_head, cfg.vocab_size, opt.tp)
    length = cache.length + valid.reshape(B, T).sum(-1).astype(cache.length.dtype)
    return logits.reshape(shape), Cache(layers=tuple(new_caches), length=length)


def local_forward(cfg: KimiK3Config, opt: StepOptions, mesh: Mesh, all_logits: bool = True):
    """(forward_local under shard_map over `mesh`, and the NamedShardings of the weights, the cache and
    a batch array): the one shard_mapped forward the decode step, the prefill and the decode loop run.

    The jitted prefill and loop fix their input and output shardings to these, so that what one
    call returns (the cache, the last token, the done flags) is what the next call was compiled
    for: without that, the outputs' shardings differ from the host-made first inputs' and the
    second chunk recompiles (seen: the decode loop compiled twice per generate)."""
    batch = P(dp_axis(mesh))
    cspecs = cache_specs(cfg, dp_axis(mesh))
    wspecs = weight_specs(cfg, mesh.shape[TP_AXIS], opt.shard_latent, opt.serving)
    local = collectives.shard_map(functools.partial(forward_local, cfg, opt, all_logits=all_logits), mesh=mesh,
                                  in_specs=(wspecs, cspecs, batch, batch), out_specs=(batch, cspecs), check_vma=False)

    def named(tree):
        return jax.tree.map(lambda p: NamedSharding(mesh, p), tree, is_leaf=lambda x: isinstance(x, P))

    return local, named(wspecs), named(cspecs), NamedSharding(mesh, batch)


def weight_specs(cfg: KimiK3Config, tp: int, shard_latent: bool, serving: bool) -> Weights:
    """The PartitionSpec of every weight array the step takes, in the checkpoint or the serving layout."""
    specs = params.partition_specs(abstract_weights(cfg, tp), shard_latent)
    return params.serve_specs(specs) if serving else specs


def serve_weights(weights: Weights, mesh: Mesh, donate: bool = False) -> Weights:
    """Placed weights (checkpoint layout) in the serving layout: each block's Fuses joined on the devices
    (params.serve_arrays); the members' arrays are dropped from the returned tree, and with `donate`
    deleted as they are joined (the caller must not use `weights` again)."""
    return params.serve_arrays(weights, mesh, donate)


LAYOUTS = ("auto", "serving", "checkpoint")


def resolve_layout(layout: Any, platform: str) -> bool:
    """Whether the model runs the serving layout: "serving" yes, "checkpoint" no, "auto" on GPUs (the
    fused GEMVs stream the weights in fewer launches there; on CPU the checkpoint layout keeps the
    arithmetic the reference tests pin, since XLA's CPU dot sums a fused matrix in another order)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: must be one of {LAYOUTS}, got {layout!r}")
    return layout == "serving" or (layout == "auto" and platform != "cpu")


def build_step(cfg: KimiK3Config, opt: StepOptions, mesh: Mesh):
    """jit(step)(weights, cache, tokens_B, valid_B) -> (logits_BV fp32, argmax_B int32, cache), with the
    cache donated: the one decode step `Model.step` and `jaxk3 bench decode` run."""
    local = local_forward(cfg, opt, mesh)[0]

    def step(weights: Weights, cache: Cache, tokens_B: jax.Array, valid_B: jax.Array):
        logits_BV, cache = local(weights, cache, tokens_B, valid_B)
        return logits_BV, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), cache

    return jax.jit(step, donate_argnames=("cache",), compiler_options=compiler_options())


def put_rows(a_BT: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host [B, T] array, rows split over the dp axis."""
    return jax.make_array_from_callback(a_BT.shape, NamedSharding(mesh, P(dp_axis(mesh))), lambda idx: a_BT[idx])


def dp_axis(mesh: Mesh) -> str | None:
    """The mesh's data-parallel axis ("dp", splitting the batch), or None."""
    return DP if DP in mesh.axis_names else None


def put_batch(a_B: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host [B] array, split over the dp axis (every process passes the same values)."""
    return jax.make_array_from_callback(a_B.shape, NamedSharding(mesh, P(dp_axis(mesh))), lambda idx: a_B[idx])


def to_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host, also when other processes hold some of its rows."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


HOST_SLICE_BYTES = 256 << 20  # the device-to-host copy of a large array, through pinned host memory, in slices of this


def host_slices(x: jax.Array, axis: int = 1, max_bytes: int | None = None):
    """Yield (start, stop, host array of x's [start, stop) along `axis`) covering x: the device-to-host copy of a large
    array (`Model.score`'s logits: 2.7 GB for a 4K row) through pinned host memory, a slice of at most `max_bytes` at a
    time with the next one in flight (a DMA at the bus's speed: 54 GB/s measured on an H200 host, where np.asarray of
    the whole array copies through pageable memory at 1.7 GB/s; docs/PERF.md).  The host arrays are read-only views of
    the pinned buffers: copy out of each before the next but one.  One slice, `to_host`, where x is not all on this
    process or its devices have no pinned host memory.  `max_bytes`: HOST_SLICE_BYTES by default."""
    n = x.shape[axis]
    max_bytes = HOST_SLICE_BYTES if max_bytes is None else max_bytes
    kinds = {m.kind for d in x.sharding.device_set for m in d.addressable_memories()}
    if not x.is_fully_addressable or "pinned_host" not in kinds or x.nbytes <= max_bytes or n < 2:
        yield 0, n, to_host(x)
        return
    per = max(1, max_bytes // (x.nbytes // n))
    pinned = x.sharding.with_memory_kind("pinned_host")
    bounds = [(s0, min(s0 + per, n)) for s0 in range(0, n, per)]

    def put(s0: int, s1: int) -> jax.Array:
        return jax.device_put(jax.lax.slice_in_dim(x, s0, s1, axis=axis), pinned)
    nxt = put(*bounds[0])
    for i, (s0, s1) in enumerate(bounds):
        cur, nxt = nxt, (put(*bounds[i + 1]) if i + 1 < len(bounds) else None)
        yield s0, s1, np.asarray(cur)
        del cur


# --------------------------------------------------------------------------- options and the mesh
def check_impl(name: str, value: Any) -> str:
    if value not in IMPLS:
        raise ValueError(f"{name}: must be one of {IMPLS}, got {value!r}")
    return value


def check_kernels(value: Any) -> str:
    from jaxk3.kernels import MODES

    if value not in MODES:
        raise ValueError(f"kernels: must be one of {MODES}, got {value!r}")
    return value


def resolve_dtype(dtype: Any) -> jnp.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype: unknown dtype {dtype!r}") from e
    if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)):
        raise ValueError(f"dtype: must be bfloat16, float16 or float32, got {dt}")
    return dt


def make_mesh(mesh: Mesh | None = None, tp: int | None = None) -> Mesh:
    """mesh=None: the first `tp` (default: all) local devices on one axis "tp"."""
    if tp is not None and isinstance(tp, (np.integer,)) and not isinstance(tp, bool):
        tp = int(tp)
    if mesh is not None:
        if TP_AXIS not in mesh.axis_names:
            raise ValueError(f"mesh: needs an axis named {TP_AXIS!r}, has {mesh.axis_names}")
        if tp is not None and mesh.shape[TP_AXIS] != tp:
            raise ValueError(f"tp: {tp} disagrees with the mesh's 'tp' axis of size {mesh.shape[TP_AXIS]}")
        return mesh
    devs = jax.local_devices()
    if tp is None:
        tp = len(devs)
    if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= len(devs):
        raise ValueError(f"tp: must be an int in 1..{len(devs)} (local devices), got {tp!r}")
    return Mesh(np.array(devs[:tp]), (TP_AXIS,))


def sharding_table(cfg: KimiK3Config, tp: int = 1) -> str:
    """The derived sharding table of `cfg`: one line per distinct (checkpoint name pattern, spec)."""
    rows: dict[str, str] = {}
    for p in params.params(abstract_weights(cfg, tp)):
        key = re.sub(r"layers\.\d+\.", "layers.*.", p.name)
        rows.setdefault(key, f"{str(p.spec):<24} {p.dtype:<8} {p.group}")
    w = max(map(len, rows))
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows.items())
