"""The model: its weight and cache trees, the TP decode step, and the public `Model`.

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
way (`cache_abstract`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxk3 import generation, params
from jaxk3._compat import shard_map
from jaxk3.config import KimiK3Config
from jaxk3.layers import attn_res as res
from jaxk3.layers import embed as embed_lib
from jaxk3.layers import kda as kda_lib
from jaxk3.layers import mla as mla_lib
from jaxk3.layers import moe as moe_lib
from jaxk3.layers.common import TP
from jaxk3.layers.kda import KDACache, KDAWeights, kda_prefill, kda_step
from jaxk3.layers.mla import MLACache, MLAWeights, mla_prefill, mla_step
from jaxk3.layers.moe import MLPWeights, MoEWeights, mlp, moe
from jaxk3.layers.norm import rms_norm
from jaxk3.params import REP, Buffer, weight
from jaxk3.sharding import DP, TP as TP_AXIS

IMPLS = ("auto", "ffi", "lax")  # collective implementations (jaxk3.collectives.IMPLS)
DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per row per prefill dispatch
# generate/score round the latent cache's length up to this: one compiled prefill and decode loop
# serve every prompt + max_new_tokens within a bucket (each new cache shape is a new compile)
CACHE_BUCKET = 512


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


def weights_from_hf(cfg: KimiK3Config, flat: Mapping[str, Any]) -> Weights:
    """Host `Weights` (numpy; vocab tables padded for TP 1) from arrays keyed by checkpoint name.
    Raises the loader's named errors (missing tensor, wrong shape, unsupported dtype)."""
    from jaxk3 import checkpoint

    return checkpoint.read_all(checkpoint.build_plan(cfg, checkpoint.ArraySource(flat), tp=1))


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
        out, conv, state = fn(cfg, w, xn, cache.conv, cache.state, valid, opt.tp)
        return out, KDACache(conv=conv, state=state)
    fn = mla_prefill if prefill else mla_step
    out, kv = fn(cfg, w, xn, cache.kv, length_B, valid, opt.tp, opt.shard_latent)
    return out, MLACache(kv=kv)


def ffn_block(cfg: KimiK3Config, opt: StepOptions, l: int, w: MLPWeights | MoEWeights, xn_ND: jax.Array,
              many: bool = False) -> jax.Array:
    """Layer `l`'s dense MLP or MoE on N normed tokens: out_ND fp32 summed over TP (`many`: the MoE's
    grouped-GEMM form, for prefill)."""
    if cfg.layer_ffn[l] == "mlp":
        return mlp(cfg, w, xn_ND, opt.tp)
    return moe(cfg, w, xn_ND, opt.tp, grouped=many)


def _mix_norm(opt: StepOptions, sources, res_norm, res_proj, ln_w, eps: float) -> jax.Array:
    """A block's normed input (fp32): AttnRes over `sources` then RMSNorm, through the `attn_res_norm`
    device kernel where `opt.kernels` and the platform allow (res.mix_norm is its reference)."""
    from jaxk3 import kernels

    return kernels.call("attn_res_norm", list(sources), res_norm, res_proj, ln_w, eps, mode=opt.kernels)


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
            xn = _mix_norm(opt, srcs, lw.self_attention_res_norm, lw.self_attention_res_proj, lw.input_layernorm,
                           eps).astype(dt).reshape(shape)
            a, c = attention_block(cfg, opt, l, lw.attn, xn, cache.layers[l], cache.length, valid)
            new_caches.append(c)
        with jax.named_scope(f"layer{g}_{cfg.layer_ffn[l]}"):
            srcs, st = res.ffn_sources(st, a.reshape(B * T, -1), g, Bs)
            xn = _mix_norm(opt, srcs, lw.mlp_res_norm, lw.mlp_res_proj, lw.post_attention_layernorm, eps).astype(dt)
            f = ffn_block(cfg, opt, l, lw.ffn, xn, prefill)
            st = res.ffn_done(st, f, Bs)
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
    wspecs = params.partition_specs(abstract_weights(cfg, mesh.shape[TP_AXIS]), opt.shard_latent)
    local = shard_map(functools.partial(forward_local, cfg, opt, all_logits=all_logits), mesh,
                      in_specs=(wspecs, cspecs, batch, batch), out_specs=(batch, cspecs))

    def named(tree):
        return jax.tree.map(lambda p: NamedSharding(mesh, p), tree, is_leaf=lambda x: isinstance(x, P))

    return local, named(wspecs), named(cspecs), NamedSharding(mesh, batch)


def build_step(cfg: KimiK3Config, opt: StepOptions, mesh: Mesh):
    """jit(step)(weights, cache, tokens_B, valid_B) -> (logits_BV fp32, argmax_B int32, cache), with the
    cache donated: the one decode step `Model.step` and `jaxk3 bench decode` run."""
    local = local_forward(cfg, opt, mesh)[0]

    def step(weights: Weights, cache: Cache, tokens_B: jax.Array, valid_B: jax.Array):
        logits_BV, cache = local(weights, cache, tokens_B, valid_B)
        return logits_BV, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), cache

    return jax.jit(step, donate_argnames=("cache",))


# --------------------------------------------------------------------------- the model
@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray  # [B, N] int32, the new tokens only (after a row's stop id: pad_id)
    logits: np.ndarray | None  # [B, N, vocab] float32: the logits each new token was chosen from
    step_times_s: list[float] = dataclasses.field(default_factory=list)  # step_by_step: wall time of each decode step
    prompt_time_s: float = 0.0  # time to first token: the prompt, synchronised at its end (includes any compile)
    decode_time_s: float = 0.0  # from the first new token to the last, on the host
    lengths: np.ndarray | None = None  # [B] new tokens per row up to and including its stop id
    prompt_tokens: int = 0  # tokens per row the prefill processed (the longest prompt, padded)


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


# XLA's CPU client runs every device's part of a launch on a shared pool and blocks a thread per
# device part while it waits in a collective; launches of several programs interleaved across
# threads could then wait on each other with no thread left to run the part they need (seen: two
# threads with two models aborted the process in XLA's all-reduce).  On CPU, a Model therefore
# runs one call at a time, process-wide, and waits for its results before the next call starts.
_CPU_CALLS = threading.RLock()


class Model:
    """A tiny-to-real Kimi-K3 / Kimi-Linear decoder, sharded over a "tp" mesh axis.  Build with
    `init_random_model`, `Model.from_weights` or `jaxk3.load_model`; decode with `generate`."""

    def __init__(self, cfg: KimiK3Config, weights: Weights, mesh: Mesh, dtype: Any, gather: str,
                 shard_latent: bool, psum: str = "auto", kernels: str = "auto"):
        self.cfg, self.weights, self.mesh = cfg, weights, mesh
        self.dtype, self.gather, self.psum, self.shard_latent = jnp.dtype(dtype), gather, psum, shard_latent
        self.kernels = check_kernels(kernels)
        self.tp = mesh.shape[TP_AXIS]
        # An optional "dp" mesh axis splits the batch (jaxk3.distributed.make_mesh: DP across
        # processes, TP inside each); weights are replicated over it.
        self.dp_axis = dp_axis(mesh)
        self.dp = mesh.shape[DP] if self.dp_axis else 1
        self.abstract = abstract_weights(cfg, self.tp)
        self.opt = StepOptions(tp_axis=TP_AXIS, gather=gather, psum=psum, shard_latent=shard_latent,
                               kernels=kernels)
        self._step = build_step(cfg, self.opt, mesh)
        self._fns: dict = {}

    # -- constructors
    @classmethod
    def from_weights(cls, cfg: KimiK3Config, weights: Mapping[str, Any] | Weights, mesh: Mesh | None = None,
                     tp: int | None = None, dtype: Any = "bfloat16", gather: str = "auto",
                     shard_latent: bool = True, psum: str = "auto", check_finite: bool = True,
                     experts: str | None = None, kernels: str = "auto") -> "Model":
        """From host arrays keyed by HF checkpoint names (or a host `Weights` pytree); every array is
        checked for NaN/Inf unless `check_finite=False` (checkpoint.NonFiniteTensorError names it).
        `experts` ("auto" | "mxfp4" | "dense", as in load_model; None: `cfg.experts_format`) picks how
        the routed experts are held."""
        from jaxk3 import checkpoint

        check_impl("gather", gather), check_impl("psum", psum), check_kernels(kernels)
        mesh = make_mesh(mesh, tp)
        dt = resolve_dtype(dtype)
        tp_size = mesh.shape[TP_AXIS]
        source = None if isinstance(weights, Weights) else checkpoint.ArraySource(weights)
        cfg.validate_tp(tp_size, shard_latent=shard_latent)
        if experts is not None:
            if source is None and experts == "auto":
                raise ValueError("experts='auto' needs arrays keyed by checkpoint name (a Weights tree "
                                 "follows cfg.experts_format)")
            cfg = checkpoint.resolve_experts(cfg, source, experts, tp_size, shard_latent)
        if source is None:
            plan = checkpoint.plan_from_arrays(abstract_weights(cfg, tp_size), weights)
        else:
            plan = checkpoint.build_plan(cfg, source, tp_size)
        placed = checkpoint.place_plan(plan, mesh, dt, shard_latent, check_finite=check_finite)
        return cls(cfg, placed, mesh, dt, gather, shard_latent, psum, kernels)

    # -- decoding
    def init_cache(self, batch: int, max_len: int) -> Cache:
        if batch % self.dp:
            raise ValueError(f"batch: {batch} rows do not split over dp={self.dp} (generate pads for you)")
        abstract = cache_abstract(self.cfg, batch, max_len)
        specs = params.buffer_specs(abstract, self.dp_axis)

        # Created in place on every device (also across processes), never on one host first.
        def zeros(b: Buffer, spec: P) -> jax.Array:
            return jax.jit(functools.partial(jnp.zeros, b.shape, b.np_dtype(self.dtype)),
                           out_shardings=NamedSharding(self.mesh, spec))()

        return jax.tree.map(zeros, abstract, specs, is_leaf=params.is_buffer)

    def step(self, cache: Cache, tokens_B: Any, valid_B: Any = None) -> tuple[jax.Array, jax.Array, Cache]:
        """One jitted decode step (cache donated): (logits [B, vocab] fp32, argmax [B], new cache).

        Checks first (ValueError): the cache was not donated to an earlier step, it matches this
        batch, and no row would write past its capacity.  The capacity check reads the cache's
        lengths, so each call waits for the step before it (`generate` is the fast path)."""
        tokens_B = np.asarray(tokens_B)
        if tokens_B.ndim != 1 or tokens_B.dtype.kind not in "iu" or np.any(
                (tokens_B < 0) | (tokens_B >= self.cfg.vocab_size)):
            raise ValueError(f"tokens_B: need a [B] array of integer ids in [0, {self.cfg.vocab_size}), got {tokens_B}")
        tokens_B = tokens_B.astype(np.int32)
        valid_B = np.ones(tokens_B.shape, bool) if valid_B is None else np.asarray(valid_B, bool)
        if valid_B.shape != tokens_B.shape:
            raise ValueError(f"valid_B: shape {valid_B.shape} differs from tokens_B's {tokens_B.shape}")
        with self._exclusive():
            self._check_cache(cache, tokens_B.shape[0], valid_B)
            # the same input sharding as the fed-back argmax: one compile
            out = self._step(self.weights, cache, put_batch(tokens_B, self.mesh), put_batch(valid_B, self.mesh))
            if self.mesh.devices.flat[0].platform == "cpu":
                jax.block_until_ready(out)
            return out

    def _check_cache(self, cache: Cache, batch: int, valid_B: np.ndarray) -> None:
        if not isinstance(cache, Cache):
            raise TypeError(f"cache: need the Cache from init_cache or the step before, got {type(cache).__name__}")
        if any(a.is_deleted() for a in jax.tree.leaves(cache)):
            raise ValueError("cache: it was donated to an earlier step and no longer exists; pass the cache that "
                             "step returned")
        if cache.length.shape != (batch,):
            raise ValueError(f"cache: made for {cache.length.shape[0]} rows, the step has {batch}")
        slots = min((c.kv.shape[1] for c in cache.layers if isinstance(c, MLACache)), default=None)
        if slots is not None:
            need = int(np.max(_to_host(cache.length) + valid_B))
            if need > slots:
                raise ValueError(f"cache: full: a row would hold {need} tokens in a cache of {slots} slots "
                                 f"(make it with init_cache(batch, max_len >= {need}))")

    def _check_prompts(self, prompt_ids: Any) -> list[list[int]]:
        """Rows of int token ids: a list of sequences, or a [B, T] integer array (TypeError/ValueError)."""
        if isinstance(prompt_ids, (str, bytes)):
            raise TypeError("prompt_ids: need token ids (a list of rows of ints), got a string: tokenize it first")
        if isinstance(prompt_ids, np.ndarray) or hasattr(prompt_ids, "shape"):
            arr = np.asarray(prompt_ids)
            if arr.ndim != 2 or arr.dtype.kind not in "iu":
                raise ValueError(f"prompt_ids: an array must be [B, T] of integers, got {arr.dtype} of shape {arr.shape}")
            rows = [list(map(int, r)) for r in arr]
        else:
            try:
                raw = list(prompt_ids)
            except TypeError:
                raise TypeError(f"prompt_ids: need a list of rows of token ids, got {type(prompt_ids).__name__}") from None
            rows = []
            for i, r in enumerate(raw):
                if isinstance(r, (str, bytes)) or not hasattr(r, "__iter__"):
                    raise TypeError(f"prompt_ids: row {i} is {r!r}, not a sequence of token ids (a batch of one "
                                    f"prompt is [[1, 2, 3]])")
                row = list(r)
                for t in row:
                    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                        raise TypeError(f"prompt_ids: row {i} has {t!r} ({type(t).__name__}); token ids are ints")
                rows.append([int(t) for t in row])
        if not rows:
            raise ValueError("prompt_ids: empty batch")
        for i, r in enumerate(rows):
            if not r:
                raise ValueError(f"prompt_ids: row {i} is empty")
            bad = [t for t in r if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt_ids: row {i} has token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        return rows

    def _exclusive(self):
        """One call at a time on CPU meshes (see _CPU_CALLS); nothing on GPU."""
        on_cpu = self.mesh.devices.flat[0].platform == "cpu"
        return _CPU_CALLS if on_cpu else contextlib.nullcontext()

    # -- generation
    def _fn(self, key: tuple, build):
        if key not in self._fns:
            self._fns[key] = build()
        return self._fns[key]

    def _layout(self, rows: list[list[int]], chunk: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Left-padded [Bp, T_total] tokens and valid mask: T_total a multiple of the prefill chunk
        (or of 64, for prompts shorter than a chunk; or T itself up to 64: the KDA chunk)."""
        T = max(len(r) for r in rows)
        if T > chunk:
            Tt = -(-T // chunk) * chunk
        else:
            Tt = T if T <= 64 else -(-T // 64) * 64
        toks, valid = self._left_pad(rows, Tt)
        return toks, valid, min(chunk, Tt)

    def _left_pad(self, rows: list[list[int]], T: int) -> tuple[np.ndarray, np.ndarray]:
        """[Bp, T] tokens and valid mask, each row's tokens at the end (rows added to split the batch
        over dp are all padding)."""
        Bp = -(-len(rows) // self.dp) * self.dp
        toks = np.zeros((Bp, T), np.int32)
        valid = np.zeros((Bp, T), bool)
        for i, r in enumerate(rows):
            toks[i, T - len(r):], valid[i, T - len(r):] = r, True
        return toks, valid

    def _prefill(self, cache: Cache, toks: np.ndarray, valid: np.ndarray, chunk: int, all_logits: bool,
                 sampling: generation.Sampling | None, progress=None):
        opt = self.opt
        fn = self._fn(("prefill", all_logits, sampling),
                      lambda: generation.build_prefill(self.cfg, opt, self.mesh, all_logits, sampling))
        outs, first, finite = [], None, None
        for c0 in range(0, toks.shape[1], chunk):
            logits, first, finite, cache = fn(self.weights, cache, put_rows(toks[:, c0:c0 + chunk], self.mesh),
                                              put_rows(valid[:, c0:c0 + chunk], self.mesh), np.int32(0))
            outs.append(logits)
            if progress is not None:
                progress("prompt", min(c0 + chunk, toks.shape[1]), toks.shape[1])
        return outs, first, finite, cache

    def score(self, token_ids: Any, prefill_chunk: int | None = None) -> np.ndarray:
        with self._exclusive():
            return self._score(token_ids, prefill_chunk)

    def _score(self, token_ids: Any, prefill_chunk: int | None) -> np.ndarray:
        """float32 logits at every position, [B, T, vocab], through the prefill path (what a
        transformers forward pass returns).  Ragged rows: row i's logits are out[i, :len_i], the rest NaN."""
        rows = self._check_prompts(token_ids)
        chunk = _check_chunk(prefill_chunk)
        toks, valid, chunk = self._layout(rows, chunk)
        cache = self.init_cache(toks.shape[0], -(-toks.shape[1] // CACHE_BUCKET) * CACHE_BUCKET)
        outs, _, _, _ = self._prefill(cache, toks, valid, chunk, True, None)
        full = np.concatenate([_to_host(o) for o in outs], axis=1)
        T = max(len(r) for r in rows)
        out = np.full((len(rows), T, self.cfg.vocab_size), np.nan, np.float32)
        for i, r in enumerate(rows):
            out[i, :len(r)] = full[i, toks.shape[1] - len(r):]
        return out

    def generate(self, prompt_ids: Any, max_new_tokens: int, return_logits: bool = False, progress: Any = None, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 stop_ids: Any = None, on_tokens: Any = None, prefill_chunk: int | None = None,
                 decode_chunk: int = 32, step_by_step: bool = False) -> GenerateOutput:
        """Generate `max_new_tokens` per prompt: the prompt through the chunked prefill, then the
        decode loop on the device, `decode_chunk` tokens per dispatch.

        Ragged prompts are left-padded; pad tokens do not touch a row's caches, so each row gets the
        tokens of running it alone.  Sampling: greedy by default; `temperature`, `top_k`, `top_p`,
        `seed` (see jaxk3.generation.Sampling).  A row stops after producing one of `stop_ids`
        (default: the config's eos_token_id, if any); its later tokens are the config's pad id (else
        -1) and `lengths` counts its tokens.  `on_tokens(tokens [B, n])` streams each chunk of new
        tokens as it arrives; `progress(phase, done, total)` reports "prompt" tokens and "decode"
        tokens.  `step_by_step=True` runs the prompt and the decode one token per dispatch (the
        original path, greedy only; kept for tests)."""
        with self._exclusive():
            return self._generate(prompt_ids, max_new_tokens, return_logits, progress, temperature, top_k, top_p,
                                  seed, stop_ids, on_tokens, prefill_chunk, decode_chunk, step_by_step)

    def _generate(self, prompt_ids, max_new_tokens, return_logits, progress, temperature, top_k, top_p, seed,
                  stop_ids, on_tokens, prefill_chunk, decode_chunk, step_by_step) -> GenerateOutput:
        rows = self._check_prompts(prompt_ids)
        if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be an int >= 1, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        sampling = generation.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if not isinstance(decode_chunk, (int, np.integer)) or decode_chunk < 1:
            raise ValueError(f"decode_chunk: must be an int >= 1, got {decode_chunk!r}")
        stops = _check_stop_ids(stop_ids, self.cfg)
        if step_by_step:
            self._check_length(rows, max_new_tokens)
            if not sampling.greedy:
                raise ValueError("step_by_step=True decodes greedily: leave temperature at 0")
            return self._generate_step_by_step(rows, max_new_tokens, return_logits, progress)
        self._check_length(rows, max_new_tokens)
        chunk = _check_chunk(prefill_chunk)
        pad_id = self.cfg.pad_token_id if self.cfg.pad_token_id is not None else -1
        B = len(rows)
        toks, valid, chunk = self._layout(rows, chunk)
        Bp, Tt = toks.shape
        K = int(min(decode_chunk, max(max_new_tokens - 1, 1)))  # the last chunk runs K steps too (unused ones dropped)
        cache = self.init_cache(Bp, -(-(Tt + max_new_tokens + K) // CACHE_BUCKET) * CACHE_BUCKET)
        t0 = time.perf_counter()
        outs, first, finite, cache = self._prefill(cache, toks, valid, chunk, False, sampling, progress)
        first_np = _to_host(first)
        ttft = time.perf_counter() - t0
        _raise_if_not_finite(~_to_host(finite)[:B], "the first new token (the prompt's last position)")
        done_np = np.isin(first_np, stops) | (np.arange(Bp) >= B)
        out_t = [first_np[:, None]]
        out_l = [_to_host(outs[-1])[:, None].astype(np.float32)] if return_logits else []
        if on_tokens is not None:
            on_tokens(first_np[:B, None])
        if progress is not None:
            progress("decode", 1, max_new_tokens)
        t1 = time.perf_counter()
        left = 0 if np.all(done_np) else max_new_tokens - 1
        opt = self.opt
        loop = None if left == 0 else self._fn(
            ("loop", K, sampling, stops, pad_id, return_logits),
            lambda: generation.build_decode_loop(self.cfg, opt, self.mesh, K, sampling, stops, pad_id, return_logits))
        tok, done = first, put_batch(done_np, self.mesh)
        pending, produced, position = None, 1, 1
        while left > 0 or pending is not None:
            launched = None
            if left > 0:  # the next chunk is queued before the previous one is read
                n = min(K, left)
                t_B, l_B, cache, tok, done, bad = loop(self.weights, cache, tok, done, np.int32(position))
                launched, position, left = (t_B, l_B, done, bad, n), position + K, left - n
            if pending is not None:
                t_B, l_B, d_B, bad_B, n = pending
                _raise_if_not_finite(_to_host(bad_B)[:B], f"new tokens {produced + 1}..{produced + n}")
                got = _to_host(t_B)[:, :n]
                out_t.append(got)
                if l_B is not None:
                    out_l.append(_to_host(l_B)[:, :n])
                produced += n
                if on_tokens is not None:
                    on_tokens(got[:B])
                if progress is not None:
                    progress("decode", produced, max_new_tokens)
                if np.all(_to_host(d_B)):  # every row stopped: the chunk in flight holds only pads
                    launched, left = None, 0
            pending = launched
        decode_s = time.perf_counter() - t1
        tokens = np.concatenate(out_t, axis=1)[:B]
        tokens = np.concatenate([tokens, np.full((B, max_new_tokens - tokens.shape[1]), pad_id, np.int32)], 1)
        logits_np = None
        if return_logits:
            logits_np = np.concatenate(out_l, axis=1)[:B]
            missing = max_new_tokens - logits_np.shape[1]
            logits_np = np.concatenate([logits_np, np.zeros((B, missing, self.cfg.vocab_size), np.float32)], 1)
        jax.block_until_ready(cache)  # a chunk queued after every row stopped is finished too
        hit = np.isin(tokens, stops)
        lengths = np.where(hit.any(1), hit.argmax(1) + 1, max_new_tokens).astype(np.int32)
        return GenerateOutput(tokens=tokens.astype(np.int32), logits=logits_np, prompt_time_s=ttft,
                              decode_time_s=decode_s, lengths=lengths, prompt_tokens=Tt)

    def _check_length(self, rows: list[list[int]], max_new_tokens: int) -> None:
        """The longest prompt + max_new_tokens against max_position_embeddings and against the cache
        memory one rank can hold (ValueError with the figures), before anything is allocated."""
        total = max(len(r) for r in rows) + max_new_tokens
        mpe = getattr(self.cfg, "max_position_embeddings", None)
        if mpe is not None and total > mpe:
            raise ValueError(f"max_new_tokens: prompt + new tokens = {total} > max_position_embeddings {mpe}")
        slots = -(-total // CACHE_BUCKET) * CACHE_BUCKET
        need = self.cfg.cache_bytes_per_rank(-(-len(rows) // self.dp), slots, self.tp, self.dtype.itemsize)
        local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        stats = local[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit is None:
            import os

            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = limit - stats.get("bytes_in_use", 0)
        if need > free:
            raise ValueError(f"max_new_tokens: the decode cache for {len(rows)} rows x {slots} positions needs "
                             f"{need / 2**30:.1f} GiB per device, more than the {free / 2**30:.1f} GiB free")

    def _generate_step_by_step(self, rows: list[list[int]], max_new_tokens: int, return_logits: bool,
                               progress: Any) -> GenerateOutput:
        """Greedy, one token per dispatch: the prompt token by token through the decode step, then
        each new token waited for (the path before the prefill and the device loop)."""
        B, T = len(rows), max(len(r) for r in rows)
        toks, valid = self._left_pad(rows, T)
        Bp = toks.shape[0]
        cache = self.init_cache(Bp, -(-(T + max_new_tokens) // 64) * 64)
        t0 = time.perf_counter()
        for t in range(T):  # Model.step reads the lengths: at most one step is queued
            logits, nxt, cache = self.step(cache, toks[:, t], valid[:, t])
        nxt.block_until_ready()
        prompt_s, times = time.perf_counter() - t0, []
        out_tok, out_logits = [nxt], [logits]
        if progress is not None:
            progress("prompt", T, T)
            progress("decode", 1, max_new_tokens)
        ones = put_batch(np.arange(Bp) < B, self.mesh)
        for _ in range(max_new_tokens - 1):
            t0 = time.perf_counter()
            logits, nxt, cache = self._step(self.weights, cache, nxt, ones)
            nxt.block_until_ready()
            times.append(time.perf_counter() - t0)
            out_tok.append(nxt)
            out_logits.append(logits)
            if progress is not None:
                progress("decode", len(out_tok), max_new_tokens)
        tokens = np.stack([_to_host(t)[:B] for t in out_tok], axis=1)
        logits_np = (np.stack([_to_host(x)[:B].astype(np.float32) for x in out_logits], axis=1)
                     if return_logits else None)
        return GenerateOutput(tokens=tokens, logits=logits_np, step_times_s=times, prompt_time_s=prompt_s,
                              decode_time_s=sum(times), prompt_tokens=T)


class NonFiniteLogitsError(FloatingPointError):
    """generate met logits that are not finite (NaN or Inf): garbage in the weights or the inputs."""


def _raise_if_not_finite(bad_B: np.ndarray, where: str) -> None:
    if np.any(bad_B):
        raise NonFiniteLogitsError(
            f"generate: the logits of row(s) {np.flatnonzero(bad_B).tolist()} at {where} are not finite (NaN/Inf); "
            "the weights or inputs hold NaN/Inf (jaxk3.load_model(..., check_finite=True) names a bad tensor)")


def _check_chunk(chunk: Any) -> int:
    if chunk is None:
        return DEFAULT_PREFILL_CHUNK
    if not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 64 or chunk % 64:
        raise ValueError(f"prefill_chunk: must be a positive multiple of 64, got {chunk!r}")
    return int(chunk)


def _check_stop_ids(stop_ids: Any, cfg: KimiK3Config) -> tuple[int, ...]:
    if stop_ids is None:
        return () if cfg.eos_token_id is None else (int(cfg.eos_token_id),)
    try:
        ids = tuple(int(i) for i in stop_ids)
    except (TypeError, ValueError):
        raise TypeError(f"stop_ids: need an iterable of token ids, got {stop_ids!r}") from None
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"stop_ids: ids outside [0, {cfg.vocab_size}): {bad}")
    return ids


def put_rows(a_BT: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host [B, T] array, rows split over the dp axis."""
    return jax.make_array_from_callback(a_BT.shape, NamedSharding(mesh, P(dp_axis(mesh))), lambda idx: a_BT[idx])


def dp_axis(mesh: Mesh) -> str | None:
    """The mesh's data-parallel axis ("dp", splitting the batch), or None."""
    return DP if DP in mesh.axis_names else None


def put_batch(a_B: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host [B] array, split over the dp axis (every process passes the same values)."""
    return jax.make_array_from_callback(a_B.shape, NamedSharding(mesh, P(dp_axis(mesh))), lambda idx: a_B[idx])


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host, also when other processes hold some of its rows."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def init_random_model(cfg: KimiK3Config, seed: int = 0, mesh: Mesh | None = None, tp: int | None = None,
                      dtype: Any = "bfloat16", gather: str = "auto", shard_latent: bool = True,
                      psum: str = "auto", kernels: str = "auto") -> Model:
    """A model with random weights (`random_hf_weights(cfg, seed)`), sharded over `mesh` (or the first
    `tp` devices); routed experts as `cfg.experts_format` says (random MXFP4 bytes for "mxfp4")."""
    check_impl("gather", gather), check_impl("psum", psum), check_kernels(kernels)
    m = make_mesh(mesh, tp)
    cfg.validate_tp(m.shape[TP_AXIS], shard_latent=shard_latent)
    return Model.from_weights(cfg, random_hf_weights(cfg, seed), mesh=m, dtype=dtype, gather=gather,
                              shard_latent=shard_latent, psum=psum, kernels=kernels)
