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

import dataclasses
import functools
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxk3 import params
from jaxk3._compat import shard_map
from jaxk3.config import KimiK3Config
from jaxk3.layers import attn_res as res
from jaxk3.layers import embed as embed_lib
from jaxk3.layers import kda as kda_lib
from jaxk3.layers import mla as mla_lib
from jaxk3.layers import moe as moe_lib
from jaxk3.layers.common import TP
from jaxk3.layers.kda import KDACache, KDAWeights, kda_step
from jaxk3.layers.mla import MLACache, MLAWeights, mla_step
from jaxk3.layers.moe import MLPWeights, MoEWeights, mlp, moe
from jaxk3.layers.norm import rms_norm
from jaxk3.params import REP, Buffer, weight
from jaxk3.sharding import DP, TP as TP_AXIS

IMPLS = ("auto", "ffi", "lax")  # collective implementations (jaxk3.collectives.IMPLS)


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
    psum: str = "lax"
    shard_latent: bool = True
    # Global index of w.layers[0] when the weights are a slice of a deeper K3 model (bench
    # decode): AttnRes then follows the global schedule, and the block snapshots completed
    # before the slice are stood in for by the embedding (same shapes, same work).
    layer_offset: int = 0

    @property
    def tp(self) -> TP | None:
        return None if self.tp_axis is None else TP(self.tp_axis, gather=self.gather, psum=self.psum)


def attention_block(cfg: KimiK3Config, opt: StepOptions, l: int, w: KDAWeights | MLAWeights, xn_BD: jax.Array,
                    cache: KDACache | MLACache, length_B: jax.Array, valid_B: jax.Array
                    ) -> tuple[jax.Array, KDACache | MLACache]:
    """Layer `l`'s attention on the normed input: (out_BD fp32 summed over TP, the layer's new cache)."""
    if cfg.layer_attn[l] == "kda":
        out, conv, state = kda_step(cfg, w, xn_BD, cache.conv, cache.state, valid_B, opt.tp)
        return out, KDACache(conv=conv, state=state)
    out, kv = mla_step(cfg, w, xn_BD, cache.kv, length_B, valid_B, opt.tp, opt.shard_latent)
    return out, MLACache(kv=kv)


def ffn_block(cfg: KimiK3Config, opt: StepOptions, l: int, w: MLPWeights | MoEWeights, xn_BD: jax.Array) -> jax.Array:
    """Layer `l`'s dense MLP or MoE on the normed input: out_BD fp32 summed over TP."""
    return (mlp if cfg.layer_ffn[l] == "mlp" else moe)(cfg, w, xn_BD, opt.tp)


def forward_local(cfg: KimiK3Config, opt: StepOptions, w: Weights, cache: Cache, tokens_B: jax.Array,
                  valid_B: jax.Array) -> tuple[jax.Array, Cache]:
    """One decode step on one rank (inside shard_map, or on one device with tp_axis=None).

    Returns (logits_BV fp32 [B, vocab], new cache).  Rows with valid_B False leave the cache alone.
    """
    dt, eps, Bs = w.embed_tokens.dtype, cfg.rms_norm_eps, cfg.attn_res_block_size
    with jax.named_scope("embed"):
        st = res.stream_start(embed_lib.embed(tokens_B, w.embed_tokens, opt.tp), Bs, opt.layer_offset)
    new_caches = []
    for l, lw in enumerate(w.layers):
        g = opt.layer_offset + l  # the layer's global index (AttnRes schedule)
        with jax.named_scope(f"layer{g}_{cfg.layer_attn[l]}"):
            h, st = res.attention_input(st, g, Bs, lw.self_attention_res_norm, lw.self_attention_res_proj, eps)
            a, c = attention_block(cfg, opt, l, lw.attn, rms_norm(h, lw.input_layernorm, eps).astype(dt),
                                   cache.layers[l], cache.length, valid_B)
            new_caches.append(c)
        with jax.named_scope(f"layer{g}_{cfg.layer_ffn[l]}"):
            h, st = res.ffn_input(st, a, g, Bs, lw.mlp_res_norm, lw.mlp_res_proj, eps)
            st = res.ffn_done(st, ffn_block(cfg, opt, l, lw.ffn, rms_norm(h, lw.post_attention_layernorm, eps)
                                            .astype(dt)), Bs)
    with jax.named_scope("head"):
        final = res.stream_final(st, Bs, w.output_attn_res_norm, w.output_attn_res_proj, eps)
        logits = embed_lib.lm_head(rms_norm(final, w.norm, eps).astype(dt), w.lm_head, cfg.vocab_size, opt.tp)
    length = cache.length + valid_B.astype(cache.length.dtype)
    return logits, Cache(layers=tuple(new_caches), length=length)


def build_step(cfg: KimiK3Config, opt: StepOptions, mesh: Mesh, abstract: Weights):
    """jit(step)(weights, cache, tokens_B, valid_B) -> (logits_BV fp32, argmax_B int32, cache), with the
    cache donated: the one decode step `Model` and `jaxk3 bench decode` run."""
    batch = P(dp_axis(mesh))
    cspecs = cache_specs(cfg, dp_axis(mesh))
    local = shard_map(functools.partial(forward_local, cfg, opt), mesh,
                      in_specs=(params.partition_specs(abstract, opt.shard_latent), cspecs, batch, batch),
                      out_specs=(batch, cspecs))

    def step(weights: Weights, cache: Cache, tokens_B: jax.Array, valid_B: jax.Array):
        logits_BV, cache = local(weights, cache, tokens_B, valid_B)
        return logits_BV, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), cache

    return jax.jit(step, donate_argnames=("cache",))


# --------------------------------------------------------------------------- the model
@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray  # [B, N] int32, the new tokens only
    logits: np.ndarray | None  # [B, N, vocab] float32: the logits each new token was chosen from
    step_times_s: list[float] = dataclasses.field(default_factory=list)  # wall time of each decode step after
    prompt_time_s: float = 0.0  # the prompt (token by token, synchronised at its end; includes any compile)


def check_impl(name: str, value: Any) -> str:
    if value not in IMPLS:
        raise ValueError(f"{name}: must be one of {IMPLS}, got {value!r}")
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


class Model:
    """A tiny-to-real Kimi-K3 / Kimi-Linear decoder, sharded over a "tp" mesh axis.  Build with
    `init_random_model`, `Model.from_weights` or `jaxk3.load_model`; decode with `generate`."""

    def __init__(self, cfg: KimiK3Config, weights: Weights, mesh: Mesh, dtype: Any, gather: str,
                 shard_latent: bool, psum: str = "lax"):
        self.cfg, self.weights, self.mesh = cfg, weights, mesh
        self.dtype, self.gather, self.psum, self.shard_latent = jnp.dtype(dtype), gather, psum, shard_latent
        self.tp = mesh.shape[TP_AXIS]
        # An optional "dp" mesh axis splits the batch (jaxk3.distributed.make_mesh: DP across
        # processes, TP inside each); weights are replicated over it.
        self.dp_axis = dp_axis(mesh)
        self.dp = mesh.shape[DP] if self.dp_axis else 1
        self.abstract = abstract_weights(cfg, self.tp)
        opt = StepOptions(tp_axis=TP_AXIS, gather=gather, psum=psum, shard_latent=shard_latent)
        self._step = build_step(cfg, opt, mesh, self.abstract)

    # -- constructors
    @classmethod
    def from_weights(cls, cfg: KimiK3Config, weights: Mapping[str, Any] | Weights, mesh: Mesh | None = None,
                     tp: int | None = None, dtype: Any = "bfloat16", gather: str = "auto",
                     shard_latent: bool = True, psum: str = "lax") -> "Model":
        """From host arrays keyed by HF checkpoint names (or a host `Weights` pytree)."""
        from jaxk3 import checkpoint

        check_impl("gather", gather), check_impl("psum", psum)
        mesh = make_mesh(mesh, tp)
        cfg.validate_tp(mesh.shape[TP_AXIS], shard_latent=shard_latent)
        dt = resolve_dtype(dtype)
        tp_size = mesh.shape[TP_AXIS]
        if isinstance(weights, Weights):
            plan = checkpoint.plan_from_arrays(abstract_weights(cfg, tp_size), weights)
        else:
            plan = checkpoint.build_plan(cfg, checkpoint.ArraySource(weights), tp_size)
        placed = checkpoint.place_plan(plan, mesh, dt, shard_latent)
        return cls(cfg, placed, mesh, dt, gather, shard_latent, psum)

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
        """One jitted decode step (cache donated): (logits [B, vocab] fp32, argmax [B], new cache)."""
        tokens_B = np.asarray(tokens_B, np.int32)
        if tokens_B.ndim != 1 or np.any((tokens_B < 0) | (tokens_B >= self.cfg.vocab_size)):
            raise ValueError(f"tokens_B: need a [B] array of ids in [0, {self.cfg.vocab_size}), got {tokens_B}")
        valid_B = np.ones(tokens_B.shape, bool) if valid_B is None else np.asarray(valid_B, bool)
        # the same input sharding as the fed-back argmax: one compile
        return self._step(self.weights, cache, put_batch(tokens_B, self.mesh), put_batch(valid_B, self.mesh))

    def _check_prompts(self, prompt_ids: Any) -> list[list[int]]:
        if isinstance(prompt_ids, np.ndarray) or hasattr(prompt_ids, "shape"):
            arr = np.asarray(prompt_ids)
            if arr.ndim != 2:
                raise ValueError(f"prompt_ids: an int array must be [B, T], got shape {arr.shape}")
            rows = [list(map(int, r)) for r in arr]
        else:
            rows = [list(map(int, r)) for r in prompt_ids]
        if not rows:
            raise ValueError("prompt_ids: empty batch")
        for i, r in enumerate(rows):
            if not r:
                raise ValueError(f"prompt_ids: row {i} is empty")
            bad = [t for t in r if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt_ids: row {i} has token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        return rows

    def generate(self, prompt_ids: Any, max_new_tokens: int, return_logits: bool = False,
                 progress: Any = None) -> GenerateOutput:
        """Greedy decoding.  Ragged prompts are left-padded; pad steps do not touch a row's caches,
        so each row gets the tokens of running it alone.  `progress(phase, done, total)`, if given, is
        called after the prompt ("prompt") and after each new token ("decode")."""
        rows = self._check_prompts(prompt_ids)
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be an int >= 1, got {max_new_tokens!r}")
        B, T = len(rows), max(len(r) for r in rows)
        Bp = -(-B // self.dp) * self.dp  # rows added to split over dp never touch a cache
        toks = np.zeros((Bp, T), np.int32)
        valid = np.zeros((Bp, T), bool)
        for i, r in enumerate(rows):
            toks[i, T - len(r):], valid[i, T - len(r):] = r, True
        cache = self.init_cache(Bp, -(-(T + max_new_tokens) // 64) * 64)
        t0 = time.perf_counter()
        for t in range(T):
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
        return GenerateOutput(tokens=tokens, logits=logits_np, step_times_s=times, prompt_time_s=prompt_s)


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
                      psum: str = "lax") -> Model:
    """A model with random weights (`random_hf_weights(cfg, seed)`), sharded over `mesh` (or the first `tp` devices)."""
    check_impl("gather", gather), check_impl("psum", psum)
    m = make_mesh(mesh, tp)
    cfg.validate_tp(m.shape[TP_AXIS], shard_latent=shard_latent)
    return Model.from_weights(cfg, random_hf_weights(cfg, seed), mesh=m, dtype=dtype, gather=gather,
                              shard_latent=shard_latent, psum=psum)
