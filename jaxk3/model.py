"""Weights / Cache pytrees, the TP decode step, greedy generation, and the public `Model`.

One decode step, per rank inside one `shard_map` over the "tp" axis (spec §3, §4):

    x = embed(tok)                                          vocab-parallel, psum
    for each layer l:
        K3:  AttnRes mix over [completed blocks…, partial p] → RMSNorm → KDA | MLA → p (+)=
             AttnRes mix → RMSNorm → MLP | MoE                  (spec §3.1 schedule)
        KL:  h += Attn(RMSNorm(h));  h += FFN(RMSNorm(h))
    K3: final AttnRes mix;  logits = lm_head(RMSNorm(h; model.norm))      vocab-parallel, gathered

Weights are named 1:1 after the HF checkpoint (spec §2): field `f` of a layer's attention block is
`model.layers.{l}.self_attn.f.weight`, and so on; `hf_tensor_shapes(cfg)` lists every checkpoint
tensor this code reads, and `weights_from_hf` is a table lookup over it (plus: experts stacked
over e, `A_log` flattened to [H], vocab tables zero-padded, the `language_model.` prefix of K3
dropped).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxk3 import sharding as shd
from jaxk3._compat import shard_map
from jaxk3.config import KimiK3Config
from jaxk3.layers.attn_res import attn_res
from jaxk3.layers.embed import embed, lm_head
from jaxk3.layers.kda import KDAWeights, kda_step
from jaxk3.layers.mla import MLAWeights, mla_step
from jaxk3.layers.moe import MLPWeights, MoEWeights, mlp, moe
from jaxk3.layers.norm import rms_norm

GATHER_IMPLS = ("auto", "ffi", "lax")


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
    """Decode state of B rows.  KDA layers stacked in `cfg.kda_layers` order, MLA in `cfg.mla_layers` order.

    conv   [L_kda, B, 3, C, W]   last W = K-1 raw q|k|v projections (activation dtype), TP over C
    state  [L_kda, B, H, K, Vd]  recurrent KDA state, fp32, fla layout (vLLM stores [H, Vd, K])
    kv     [L_mla, B, S, R]      latent cache [c_kv | k_pe] (activation dtype), replicated
    length [B] int32             tokens cached per row (the next token's position)
    """
    conv: jax.Array
    state: jax.Array
    kv: jax.Array
    length: jax.Array


@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray  # [B, N] int32, the new tokens only
    logits: np.ndarray | None  # [B, N, vocab] float32: the logits each new token was chosen from
    step_times_s: list[float] = dataclasses.field(default_factory=list)  # wall time of each decode step after
    prompt_time_s: float = 0.0  # the prompt (token by token, synchronised at its end; includes any compile)


# ------------------------------------------------------------------- HF names and shapes
def _attn_fields(cfg: KimiK3Config, kind: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint tensors of one attention block: field -> (shape, init kind)."""
    D = cfg.hidden_size
    if kind == "kda":
        C, H, d, K = cfg.kda_dim, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
        f = dict(q_proj=((C, D), "w"), k_proj=((C, D), "w"), v_proj=((C, D), "w"),
                 q_conv1d=((C, 1, K), "conv"), k_conv1d=((C, 1, K), "conv"), v_conv1d=((C, 1, K), "conv"),
                 f_a_proj=((d, D), "w"), f_b_proj=((C, d), "w"), b_proj=((H, D), "w"),
                 A_log=((H,) if cfg.gate_lower_bound is not None else (1, 1, H, 1), "a_log"),
                 dt_bias=((C,), "dt"), o_norm=((d,), "norm"), o_proj=((D, C), "w"))
        if cfg.use_full_rank_gate:
            f["g_proj"] = ((C, D), "w")
        else:
            f.update(g_a_proj=((d, D), "w"), g_b_proj=((C, d), "w"))
        return f
    H, n, r, v, R = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    f = dict(kv_a_proj_with_mqa=((R + r, D), "w"), kv_a_layernorm=((R,), "norm"),
             kv_b_proj=((H * (n + v), R), "w"), o_proj=((D, H * v), "w"))
    if cfg.q_lora_rank is not None:
        Q = cfg.q_lora_rank
        f.update(q_a_proj=((Q, D), "w"), q_a_layernorm=((Q,), "norm"), q_b_proj=((H * (n + r), Q), "w"))
    else:
        f["q_proj"] = ((H * (n + r), D), "w")
    if cfg.mla_use_output_gate:
        f["g_proj"] = ((H * v, D), "w")
    return f


def _hf_suffix(field: str) -> str:
    return field if field in ("A_log", "dt_bias") else f"{field}.weight"


def hf_tensor_shapes(cfg: KimiK3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every HF checkpoint tensor the model reads: name -> (shape, init kind)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((V, D), "embed"), "model.norm.weight": ((D,), "norm")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((V, D), "head")
    if cfg.attn_res_block_size is not None:
        out.update({"model.output_attn_res_norm.weight": ((D,), "norm"),
                    "model.output_attn_res_proj.weight": ((1, D), "res")})
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        out[p + "input_layernorm.weight"] = ((D,), "norm")
        out[p + "post_attention_layernorm.weight"] = ((D,), "norm")
        if cfg.attn_res_block_size is not None:
            for nm in ("self_attention_res", "mlp_res"):
                out[f"{p}{nm}_norm.weight"] = ((D,), "norm")
                out[f"{p}{nm}_proj.weight"] = ((1, D), "res")
        for fld, sh in _attn_fields(cfg, cfg.layer_attn[l]).items():
            out[p + "self_attn." + _hf_suffix(fld)] = sh
        if cfg.layer_ffn[l] == "mlp":
            I = cfg.intermediate_size
            out.update({p + "mlp.gate_proj.weight": ((I, D), "w"), p + "mlp.up_proj.weight": ((I, D), "w"),
                        p + "mlp.down_proj.weight": ((D, I), "w")})
            continue
        m, E, I, L = p + "block_sparse_moe.", cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_hidden
        out[m + "gate.weight"] = ((E, D), "w")
        out[m + "gate.e_score_correction_bias"] = ((E,), "bias")
        for e in range(E):
            out.update({f"{m}experts.{e}.w1.weight": ((I, L), "w"), f"{m}experts.{e}.w3.weight": ((I, L), "w"),
                        f"{m}experts.{e}.w2.weight": ((L, I), "w")})
        if cfg.num_shared_experts:
            Is = cfg.shared_intermediate_size
            out.update({m + "shared_experts.gate_proj.weight": ((Is, D), "w"),
                        m + "shared_experts.up_proj.weight": ((Is, D), "w"),
                        m + "shared_experts.down_proj.weight": ((D, Is), "w")})
        if cfg.routed_expert_hidden_size is not None:
            out.update({m + "routed_expert_down_proj.weight": ((L, D), "w"),
                        m + "routed_expert_norm.weight": ((L,), "norm"),
                        m + "routed_expert_up_proj.weight": ((D, L), "w")})
    return out


def random_hf_weights(cfg: KimiK3Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights keyed by HF names (spec §7.1 init; see docs/MODEL.md)."""
    rng = np.random.default_rng(seed)
    D = cfg.hidden_size
    out = {}
    for name, (shape, kind) in hf_tensor_shapes(cfg).items():
        if kind == "norm":
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif kind == "a_log":
            a = np.log(rng.uniform(1.0, 16.0, shape))
        elif kind == "dt":
            a = rng.standard_normal(shape)
        elif kind == "bias":
            a = 0.1 * rng.standard_normal(shape)
        elif kind == "conv":
            a = 0.3 * rng.standard_normal(shape)
        elif kind == "embed":
            a = rng.standard_normal(shape)
        elif kind == "head":
            a = rng.standard_normal(shape) / math.sqrt(D)
        elif kind == "res":
            a = 0.1 * rng.standard_normal(shape)
        else:
            a = 0.02 * rng.standard_normal(shape)
        out[name] = a.astype(np.float32)
    return out


def _strip_prefix(flat: Mapping[str, Any]) -> dict[str, Any]:
    """K3 multimodal checkpoints prefix the text model with `language_model.`."""
    out = {}
    for k, v in flat.items():
        if k.startswith("language_model."):
            k = k[len("language_model."):]
            if k.startswith("layers."):
                k = "model." + k
        out[k] = v
    return out


def weights_from_hf(cfg: KimiK3Config, flat: Mapping[str, Any]) -> Weights:
    """Host `Weights` (numpy, checkpoint dtypes) from a dict keyed by HF checkpoint names."""
    flat = _strip_prefix(flat)
    want = hf_tensor_shapes(cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" in flat:
        want["lm_head.weight"] = want["model.embed_tokens.weight"]

    def get(name: str) -> np.ndarray:
        if name not in flat:
            raise ValueError(f"checkpoint: missing tensor {name!r}")
        a = np.asarray(flat[name])
        if tuple(a.shape) != tuple(want[name][0]):
            if name.endswith("A_log") and a.size >= cfg.kda_num_heads:  # [128] (K3) or [1,1,H,1]
                return a.reshape(-1)[: cfg.kda_num_heads]
            raise ValueError(f"checkpoint: {name!r} has shape {tuple(a.shape)}, expected {want[name][0]}")
        return a.reshape(-1)[: cfg.kda_num_heads] if name.endswith("A_log") else a

    def experts(m: str, i: int) -> np.ndarray:
        return np.stack([get(f"{m}experts.{e}.w{i}.weight") for e in range(cfg.num_experts)])

    tied = cfg.tie_word_embeddings and "lm_head.weight" not in flat
    return assemble_weights(cfg, get, experts, tied_head=tied)


def assemble_weights(cfg: KimiK3Config, leaf: Callable[[str], Any], experts: Callable[[str, int], Any],
                     tied_head: bool) -> Weights:
    """The `Weights` tree of `cfg`: every leaf is `leaf(hf_name)`, each stacked expert tensor
    `experts(moe_prefix, i)` for w1, w2, w3 (i = 1, 2, 3).  The one walk over the checkpoint
    names, shared by in-memory weights (`weights_from_hf`) and the safetensors loader."""

    def block(cls, prefix: str, fields: Sequence[str]):
        return cls(**{f: leaf(prefix + _hf_suffix(f)) for f in fields})

    layers = []
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        kind = cfg.layer_attn[l]
        attn = block(KDAWeights if kind == "kda" else MLAWeights, p + "self_attn.", _attn_fields(cfg, kind))
        if cfg.layer_ffn[l] == "mlp":
            ffn = block(MLPWeights, p + "mlp.", ("gate_proj", "up_proj", "down_proj"))
        else:
            m = p + "block_sparse_moe."
            latent = cfg.routed_expert_hidden_size is not None
            ffn = MoEWeights(
                gate=leaf(m + "gate.weight"), e_score_correction_bias=leaf(m + "gate.e_score_correction_bias"),
                experts_w1=experts(m, 1), experts_w2=experts(m, 2), experts_w3=experts(m, 3),
                shared_experts=(block(MLPWeights, m + "shared_experts.", ("gate_proj", "up_proj", "down_proj"))
                                if cfg.num_shared_experts else None),
                **({f: leaf(m + f + ".weight") for f in
                    ("routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj")} if latent else {}))
        res = {}
        if cfg.attn_res_block_size is not None:
            res = {f: leaf(p + f + ".weight") for f in
                   ("self_attention_res_norm", "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj")}
        layers.append(LayerWeights(attn=attn, ffn=ffn, input_layernorm=leaf(p + "input_layernorm.weight"),
                                   post_attention_layernorm=leaf(p + "post_attention_layernorm.weight"), **res))
    emb = leaf("model.embed_tokens.weight")
    head = emb if tied_head else leaf("lm_head.weight")
    top = {}
    if cfg.attn_res_block_size is not None:
        top = dict(output_attn_res_norm=leaf("model.output_attn_res_norm.weight"),
                   output_attn_res_proj=leaf("model.output_attn_res_proj.weight"))
    return Weights(embed_tokens=emb, lm_head=head, norm=leaf("model.norm.weight"), layers=tuple(layers), **top)


# --------------------------------------------------------------------------- the step
@dataclasses.dataclass(frozen=True)
class StepOptions:
    tp_axis: str | None = shd.TP
    gather: str = "auto"
    shard_latent: bool = True
    # Global index of w.layers[0] when the weights are a slice of a deeper K3 model (bench
    # decode): AttnRes then follows the global schedule, and the block snapshots completed
    # before the slice are stood in for by the embedding (same shapes, same work).
    layer_offset: int = 0


def forward_local(cfg: KimiK3Config, opt: StepOptions, w: Weights, cache: Cache, tokens_B: jax.Array,
                  valid_B: jax.Array) -> tuple[jax.Array, Cache]:
    """One decode step on one rank (inside shard_map, or on one device with tp_axis=None).

    Returns (logits_BV fp32 [B, vocab], new cache).  Rows with valid_B False leave the cache alone.
    """
    dt = w.embed_tokens.dtype
    eps = cfg.rms_norm_eps
    conv, state, kv = cache.conv, cache.state, cache.kv
    ik = im = 0

    def attention(l: int, lw: LayerWeights, xn_BD: jax.Array) -> jax.Array:
        nonlocal conv, state, kv, ik, im
        if cfg.layer_attn[l] == "kda":
            out, c, s = kda_step(cfg, lw.attn, xn_BD, conv[ik], state[ik], valid_B, opt.tp_axis)
            conv, state = conv.at[ik].set(c), state.at[ik].set(s)
            ik += 1
        else:
            out, k = mla_step(cfg, lw.attn, xn_BD, kv[im], cache.length, valid_B, opt.tp_axis,
                              opt.shard_latent, opt.gather)
            kv = kv.at[im].set(k)
            im += 1
        return out

    def ffn(l: int, lw: LayerWeights, xn_BD: jax.Array) -> jax.Array:
        if cfg.layer_ffn[l] == "mlp":
            return mlp(cfg, lw.ffn, xn_BD, opt.tp_axis)
        return moe(cfg, lw.ffn, xn_BD, opt.tp_axis)

    x_BD = embed(tokens_B, w.embed_tokens, opt.tp_axis)
    Bs = cfg.attn_res_block_size
    if Bs is None:  # Kimi-Linear: plain pre-norm residual stream in the activation dtype
        h = x_BD
        for l, lw in enumerate(w.layers):
            h = (h + attention(l, lw, rms_norm(h, lw.input_layernorm, eps).astype(dt))).astype(dt)
            h = (h + ffn(l, lw, rms_norm(h, lw.post_attention_layernorm, eps).astype(dt))).astype(dt)
        final = h
    else:  # K3: block Attention Residuals (spec §3.1)
        off = opt.layer_offset
        p, blocks, mlp_out = x_BD, [x_BD] * -(-off // Bs), None
        for l, lw in enumerate(w.layers):
            g = off + l  # the layer's global index
            if l > 0:
                p = (p + mlp_out).astype(dt)
            starts_block = g % Bs == 0
            if starts_block:
                blocks.append(p)
            nsrc = -(-g // Bs)  # completed blocks visible before attention
            h = attn_res(blocks[:nsrc] + [p], lw.self_attention_res_norm, lw.self_attention_res_proj, eps)
            a = attention(l, lw, rms_norm(h, lw.input_layernorm, eps).astype(dt))
            p = a.astype(dt) if starts_block else (p + a).astype(dt)
            nsrc += starts_block
            h = attn_res(blocks[:nsrc] + [p], lw.mlp_res_norm, lw.mlp_res_proj, eps)
            mlp_out = ffn(l, lw, rms_norm(h, lw.post_attention_layernorm, eps).astype(dt))
        p = (p + mlp_out).astype(dt)
        final = attn_res(blocks + [p], w.output_attn_res_norm, w.output_attn_res_proj, eps)
    logits = lm_head(rms_norm(final, w.norm, eps).astype(dt), w.lm_head, cfg.vocab_size, opt.tp_axis, opt.gather)
    length = cache.length + valid_B.astype(cache.length.dtype)
    return logits, Cache(conv=conv, state=state, kv=kv, length=length)


# --------------------------------------------------------------------------- the model
def _resolve_dtype(dtype: Any) -> jnp.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype: unknown dtype {dtype!r}") from e
    if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)):
        raise ValueError(f"dtype: must be bfloat16, float16 or float32, got {dt}")
    return dt


def make_mesh(mesh: Mesh | None = None, tp: int | None = None) -> Mesh:
    """mesh=None: the first `tp` (default: all) local devices on one axis "tp"."""
    if mesh is not None:
        if shd.TP not in mesh.axis_names:
            raise ValueError(f"mesh: needs an axis named {shd.TP!r}, has {mesh.axis_names}")
        if tp is not None and mesh.shape[shd.TP] != tp:
            raise ValueError(f"tp: {tp} disagrees with the mesh's 'tp' axis of size {mesh.shape[shd.TP]}")
        return mesh
    devs = jax.local_devices()
    if tp is None:
        tp = len(devs)
    if not isinstance(tp, int) or not 1 <= tp <= len(devs):
        raise ValueError(f"tp: must be an int in 1..{len(devs)} (local devices), got {tp!r}")
    return Mesh(np.array(devs[:tp]), (shd.TP,))


def place_weights(cfg: KimiK3Config, host: Weights, mesh: Mesh, dtype: Any, shard_latent: bool) -> Weights:
    """Cast (fp32 where the table says), pad the vocab tables, and shard every weight over the mesh."""
    tp = mesh.shape[shd.TP]
    vpad = cfg.padded_vocab(tp)

    def put(key: str, a: Any) -> jax.Array:
        a = np.asarray(a)
        dt = np.float32 if key in shd.FP32_WEIGHTS else dtype
        if key in ("model.embed_tokens", "model.lm_head") and a.shape[0] != vpad:
            a = np.concatenate([a, np.zeros((vpad - a.shape[0],) + a.shape[1:], a.dtype)])
        return jax.device_put(jnp.asarray(a, dtype=dt), NamedSharding(mesh, shd.spec(key, shard_latent)))

    return shd.map_weights(put, host)


class Model:
    """A tiny-to-real Kimi-K3 / Kimi-Linear decoder, sharded over a "tp" mesh axis.  Build with
    `init_random_model` or `Model.from_weights`; decode with `generate`."""

    def __init__(self, cfg: KimiK3Config, weights: Weights, mesh: Mesh, dtype: Any, gather: str,
                 shard_latent: bool):
        self.cfg, self.weights, self.mesh = cfg, weights, mesh
        self.dtype, self.gather, self.shard_latent = jnp.dtype(dtype), gather, shard_latent
        self.tp = mesh.shape[shd.TP]
        # An optional "dp" mesh axis splits the batch (jaxk3.distributed.make_mesh: DP across
        # processes, TP inside each); weights are replicated over it.
        self.dp_axis = dp_axis(mesh)
        self.dp = mesh.shape[shd.DP] if self.dp_axis else 1
        batch = P(self.dp_axis)
        opt = StepOptions(tp_axis=shd.TP, gather=gather, shard_latent=shard_latent)
        wspecs = shd.weight_specs(weights, shard_latent)
        self._cache_specs = Cache(**shd.cache_specs(self.dp_axis))
        local = shard_map(functools.partial(forward_local, cfg, opt), mesh,
                          in_specs=(wspecs, self._cache_specs, batch, batch), out_specs=(batch, self._cache_specs))

        def step(weights: Weights, cache: Cache, tokens_B: jax.Array, valid_B: jax.Array):
            logits_BV, cache = local(weights, cache, tokens_B, valid_B)
            return logits_BV, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), cache

        self._step = jax.jit(step, donate_argnames=("cache",))

    # -- constructors
    @classmethod
    def from_weights(cls, cfg: KimiK3Config, weights: Mapping[str, Any] | Weights, mesh: Mesh | None = None,
                     tp: int | None = None, dtype: Any = "bfloat16", gather: str = "auto",
                     shard_latent: bool = True) -> "Model":
        """From host arrays keyed by HF checkpoint names (or a host `Weights` pytree)."""
        if gather not in GATHER_IMPLS:
            raise ValueError(f"gather: must be one of {GATHER_IMPLS}, got {gather!r}")
        mesh = make_mesh(mesh, tp)
        cfg.validate_tp(mesh.shape[shd.TP], shard_latent=shard_latent)
        dt = _resolve_dtype(dtype)
        host = weights if isinstance(weights, Weights) else weights_from_hf(cfg, weights)
        return cls(cfg, place_weights(cfg, host, mesh, dt, shard_latent), mesh, dt, gather, shard_latent)

    # -- decoding
    def init_cache(self, batch: int, max_len: int) -> Cache:
        shapes = cache_shapes(self.cfg, batch, max_len, self.dtype)
        if batch % self.dp:
            raise ValueError(f"batch: {batch} rows do not split over dp={self.dp} (generate pads for you)")
        # Created in place on every device (also across processes), never on one host first.
        return Cache(**{k: jax.jit(functools.partial(jnp.zeros, s, d),
                                   out_shardings=NamedSharding(self.mesh, getattr(self._cache_specs, k)))()
                        for k, (s, d) in shapes.items()})

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
    return shd.DP if shd.DP in mesh.axis_names else None


def put_batch(a_B: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host [B] array, split over the dp axis (every process passes the same values)."""
    return jax.make_array_from_callback(a_B.shape, NamedSharding(mesh, P(dp_axis(mesh))), lambda idx: a_B[idx])


def cache_shapes(cfg: KimiK3Config, batch: int, max_len: int, dtype: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Global shape and dtype of every Cache field (the KDA recurrent state is fp32)."""
    Lk, Lm = len(cfg.kda_layers), len(cfg.mla_layers)
    return dict(
        conv=((Lk, batch, 3, cfg.kda_dim, cfg.short_conv_kernel_size - 1), jnp.dtype(dtype)),
        state=((Lk, batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.dtype(jnp.float32)),
        kv=((Lm, batch, max_len, cfg.latent_dim), jnp.dtype(dtype)),
        length=((batch,), jnp.dtype(jnp.int32)))


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host, also when other processes hold some of its rows."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def init_random_model(cfg: KimiK3Config, seed: int = 0, mesh: Mesh | None = None, tp: int | None = None,
                      dtype: Any = "bfloat16", gather: str = "auto", shard_latent: bool = True) -> Model:
    """A model with random weights (spec §7.1 init), sharded over `mesh` (or the first `tp` devices)."""
    if gather not in GATHER_IMPLS:
        raise ValueError(f"gather: must be one of {GATHER_IMPLS}, got {gather!r}")
    m = make_mesh(mesh, tp)
    cfg.validate_tp(m.shape[shd.TP], shard_latent=shard_latent)
    return Model.from_weights(cfg, random_hf_weights(cfg, seed), mesh=m, dtype=dtype, gather=gather,
                              shard_latent=shard_latent)
