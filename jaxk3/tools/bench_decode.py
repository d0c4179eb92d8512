"""`jaxk3 bench decode`: one decode step of a layer slice, four strategies, same run.

Strategies (same random weights, same random caches, same tokens):

  stock             the latent projections replicated (shard_latent=False: MLA q_a_proj /
                    kv_a_proj_with_mqa, the MoE's routed_expert_down/up_proj), dense experts,
                    gathers via lax
  sharded+lax       latent projections split (one lax.all_gather per MLA layer and per latent MoE)
  sharded+one-shot  the same split, the one-shot FFI gather (the logits gather takes the FFI
                    path too where it fits under JAXK3_GATHER_MAX_BYTES, lax above; recorded)
  packed+sharded+one-shot   sharded+one-shot with the routed experts MXFP4 (random packed bytes,
                    experts_format="mxfp4"): other weights than the dense strategies', so its
                    tokens are not compared with theirs

For each (batch, MLA context) and strategy: the median step latency over many steps after
warm-up (steps enqueued back to back with the cache donated, the greedy token fed back on
device, wall time / steps; and, separately, each step synchronised), the bytes each rank reads
per step (weights counted from the per-device shard sizes of the placed arrays, routed experts
only for the distinct experts a step is expected
to touch (E·(1-(1-k/E)^B) for uniform routing, `expected_experts`), the embedding only for its B rows; caches
separately), the device's measured copy bandwidth (a large device-to-device copy: read +
write bytes / time), the floor bytes / bandwidth, and the ratio to it.

Layer slice.  `--layers 11-14` keeps those (0-based, docs/SPEC.md §1.2) layers of the config with
their kinds (K3: 11 MLA, 12-14 KDA, all MoE).  The step is the model's own (`model.build_step`)
with `StepOptions.layer_offset`: the layers run with their global index for the AttnRes schedule
(a block starts where global l % 12 == 0, so 12 starts one); the completed-block snapshots before
the slice are stood in for by the embedding (same shapes, so the same work).
The embedding and lm_head (vocab-parallel, full vocab) are part of the step.

`--experts N` keeps N routed experts per MoE layer (memory): a decode step reads only the top-k
selected experts (`jnp.take`), so the per-token work is unchanged as long as N >= B*k; the byte
count uses the expected distinct experts, N·(1-(1-k/N)^B).  Weights are random, generated on the devices, already sharded.

`--census` (`census_decode`): instead of the latency run, the kernel census of the same step per
(batch, context, strategy): kernels per named-scope block (embed, each layer's attention and
ffn, head) by kind, from the optimized HLO, and the device time per block from a profile of a
few steps (jaxk3/census.py); on a GPU also the timeline of those back-to-back steps (census.device_timeline: how
long a step spans, how much of it the GPU is busy, the idle gaps between its events by length), with XLA's command
buffers as the process's XLA_FLAGS set them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxk3 import checkpoint, collectives, params
from jaxk3.tools import aot, census
from jaxk3.config import KimiK3Config
from jaxk3.kernels import kda_decode
from jaxk3.kernels.moe_experts import F16_SCALES, with_f16
from jaxk3.layers.kda import KDACache
from jaxk3.model import (Cache, StepOptions, Weights, abstract_weights, build_step, cache_abstract, dp_axis,
                         put_batch, resolve_layout, serve_weights, to_host)
from jaxk3.sharding import DP, TP

class Strategy(NamedTuple):
    name: str
    shard_latent: bool
    gather: str  # lax | ffi (ffi: "auto" where a gather does not fit)
    experts: str = "dense"  # routed experts: dense | mxfp4
    kernels: str = "auto"  # device kernels (jaxk3.kernels): auto | off | on
    layout: str = "auto"  # weights: auto (serving on GPUs) | serving | checkpoint (jaxk3.model.resolve_layout)


def with_layouts(strategies, layouts) -> tuple[Strategy, ...]:
    """Each strategy in each weight layout (`--layouts checkpoint,serving`); names get "[<layout>]"
    unless the one layout is auto."""
    layouts = tuple(layouts)
    if layouts == ("auto",):
        return tuple(strategies)
    return tuple(s._replace(name=f"{s.name}[{lay}]", layout=lay) for s in strategies for lay in layouts)


def with_variants(strategies, variants) -> tuple[Strategy, ...]:
    """Each strategy in each (layout, kernel mode) pair (`--variants checkpoint/off,serving/auto`)."""
    return tuple(s._replace(name=f"{s.name}[{lay}/{ker}]", layout=lay, kernels=ker)
                 for s in strategies for lay, ker in variants)


def with_kernels(strategies, modes) -> tuple[Strategy, ...]:
    """Each strategy under each kernel mode (`--kernels off,on`); names get "[kernels=<mode>]" unless
    the one mode is auto."""
    modes = tuple(modes)
    if modes == ("auto",):
        return tuple(strategies)
    return tuple(s._replace(name=f"{s.name}[kernels={m}]", kernels=m) for s in strategies for m in modes)


STRATEGIES = (Strategy("stock", False, "lax"), Strategy("sharded+lax", True, "lax"),
              Strategy("sharded+one-shot", True, "ffi"), Strategy("packed+sharded+one-shot", True, "ffi", "mxfp4"))


# ------------------------------------------------------------------------------ config
# Kimi-Linear-48B-A3B's text config (hub values, docs/SPEC.md §1.1)
KIMI_LINEAR_48B = dict(
    model_type="kimi_linear", vocab_size=163840, hidden_size=2304, num_hidden_layers=27, rms_norm_eps=1e-5,
    num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, mla_use_nope=True,
    linear_attn_config=dict(full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
                            kda_layers=[i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                            num_heads=32, head_dim=128, short_conv_kernel_size=4),
    first_k_dense_replace=1, moe_layer_freq=1, intermediate_size=9216, num_experts=256, num_experts_per_token=8,
    num_shared_experts=1, moe_intermediate_size=1024, moe_router_activation_func="sigmoid", use_grouped_topk=True,
    num_expert_group=1, topk_group=1, moe_renormalize=True, routed_scaling_factor=2.446, hidden_act="silu",
    tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    max_position_embeddings=1048576)


def load_config(name: str) -> KimiK3Config:
    """A bench preset (k3, kimi-linear-48b, tiny) or a HF config.json / model directory."""
    if name == "k3":
        return KimiK3Config.k3()
    if name == "kimi-linear-48b":
        return KimiK3Config.from_pretrained(KIMI_LINEAR_48B)
    if name == "tiny":
        return KimiK3Config.tiny_k3()
    return KimiK3Config.from_pretrained(name)


def parse_layers(text: str | None, cfg: KimiK3Config) -> tuple[int, int]:
    """'11-14' (0-based, inclusive), '12' or None (all layers)."""
    if text is None or text == "all":
        return 0, cfg.num_hidden_layers - 1
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    if not m:
        raise ValueError(f"--layers: expected FIRST-LAST (0-based, inclusive), got {text!r}")
    first, last = int(m.group(1)), int(m.group(2) or m.group(1))
    if not 0 <= first <= last < cfg.num_hidden_layers:
        raise ValueError(f"--layers {text}: the config has layers 0..{cfg.num_hidden_layers - 1}")
    return first, last


def slice_config(cfg: KimiK3Config, first: int, last: int, experts: int | None = None) -> KimiK3Config:
    """The config of layers first..last (kinds kept); the layer offset is `first`."""
    changes: dict[str, Any] = dict(num_hidden_layers=last - first + 1, layer_attn=cfg.layer_attn[first:last + 1],
                                   layer_ffn=cfg.layer_ffn[first:last + 1])
    if experts is not None and experts != cfg.num_experts:
        if experts < cfg.num_experts_per_token:
            raise ValueError(f"--experts {experts}: fewer than the {cfg.num_experts_per_token} experts per token")
        changes["num_experts"] = experts
    return dataclasses.replace(cfg, **changes)


def describe_slice(cfg: KimiK3Config, first: int, last: int) -> str:
    kinds = " ".join(f"{first + i}:{a.upper()}+{f.upper()}" for i, (a, f) in enumerate(zip(cfg.layer_attn, cfg.layer_ffn)))
    Bs = cfg.attn_res_block_size
    starts = [l for l in range(first, last + 1) if Bs and l % Bs == 0]
    return f"layers {first}-{last} [{kinds}]" + (f"; AttnRes block starts at {starts} (block {Bs})" if Bs else "")


# ----------------------------------------------------------------- random device arrays
def random_weights(cfg: KimiK3Config, mesh, dtype, shard_latent: bool, seed: int = 0) -> Weights:
    """Random weights (each weight's declared init) generated on the devices in their final sharding."""
    return params.random_on_devices(abstract_weights(cfg, mesh.shape[TP]), mesh, dtype, cfg.hidden_size,
                                    shard_latent=shard_latent, seed=seed)


def relayout_latent(cfg: KimiK3Config, weights: Weights, mesh, shard_latent: bool) -> Weights:
    """The same weights with the latent projections placed for `shard_latent` (the rest shared)."""
    def put(p: params.Param, a):
        if p.spec in (params.LATENT, params.LATENT_ROW):
            return jax.device_put(a, NamedSharding(mesh, p.pspec(shard_latent)))
        return a

    return jax.tree.map(put, abstract_weights(cfg, mesh.shape[TP]), weights, is_leaf=params.is_param)


def random_cache(cfg: KimiK3Config, mesh, dtype, batch: int, context: int, seed: int = 1) -> Cache:
    """Caches filled with random data; every row has context-1 tokens, so the MLA step attends to all.  A KDA conv
    cache laid out as the ring (`jaxk3.kernels.kda_decode.RING`) holds the shift form's random window at the rows'
    position (tap t in slot (context + t) mod K), so that both layouts decode the same tokens."""
    abstract = cache_abstract(cfg, batch, context)
    specs = params.buffer_specs(abstract, dp_axis(mesh))
    counter = iter(range(1 << 30))
    K = cfg.short_conv_kernel_size

    def fill(path, b: params.Buffer, spec):
        scale = {"fp32": 0.01}.get(b.dtype, 0.1 if len(b.shape) == 4 else 1.0)  # KDA state / conv / MLA latents
        dt = b.np_dtype(dtype)
        ring = getattr(path[-1], "name", None) == "conv" and b.shape[-1] == K
        shape = (*b.shape[:-1], K - 1) if ring else b.shape

        def draw(k):
            x = jax.random.normal(k, shape, jnp.float32) * scale
            if ring:  # the window (positions context-K .. context-2) and this token's slot, a zero the step overwrites
                x = kda_decode.ring_place(jnp.concatenate([x, jnp.zeros((*shape[:-1], 1), x.dtype)], axis=-1),
                                          jnp.full((shape[0],), context))
            return x.astype(dt)
        f = jax.jit(draw, out_shardings=NamedSharding(mesh, spec))
        return f(jax.random.fold_in(jax.random.key(seed), next(counter)))

    layers = jax.tree_util.tree_map_with_path(fill, abstract.layers, specs.layers, is_leaf=params.is_buffer)
    return Cache(layers=layers, length=put_batch(np.full((batch,), context - 1, np.int32), mesh))


def top2_margin(logits_BV: np.ndarray) -> float:
    """min over the rows of (largest logit - second largest) / max|logit| (0.0 for a tie)."""
    top = np.sort(logits_BV.reshape(-1, logits_BV.shape[-1]), axis=-1)[:, -2:]
    return float(np.min(top[:, 1] - top[:, 0]) / max(float(np.max(np.abs(logits_BV))), 1e-30))


# --------------------------------------------------------------------------- accounting
def expected_experts(num_experts: int, k: int, batch: int) -> float:
    """Distinct experts a step of `batch` tokens touches when each token picks k of E uniformly:
    E · (1 - (1 - k/E)^B).  (Kimi-Linear at E 64, k 8, B 8: 42.0; 40.6 measured on random weights.)"""
    return num_experts * (1.0 - (1.0 - k / num_experts) ** batch)


def weight_bytes_per_rank(cfg: KimiK3Config, weights: Weights, batch: int) -> dict[str, int]:
    """Bytes one rank's step must read, by the declared weight groups (params.bytes_per_rank); routed
    experts: the distinct experts the step is expected to touch (`expected_experts`), each read once."""
    tp = weights.embed_tokens.sharding.mesh.shape[TP]
    touched = expected_experts(cfg.num_experts, cfg.num_experts_per_token, batch)
    return params.bytes_per_rank(abstract_weights(cfg, tp), weights, experts_touched=touched, rows=batch)


def cache_bytes_per_rank(cfg: KimiK3Config, cache: Cache) -> int:
    """MLA latent cache read once (replicated: every rank reads all of it), KDA state and conv read + written."""
    return sum(layer_cache_bytes(cfg, c) for c in cache.layers)


def layer_cache_bytes(cfg: KimiK3Config, c) -> int:
    """One layer's cache bytes a step moves per rank: an MLA latent cache read once; a KDA state read and written,
    and its conv window read and written whole (the shift form's K-1 slots), or as the ring of K slots (K-1 read,
    one written: its own size once)."""
    if not isinstance(c, KDACache):
        return sum(params.shard_bytes(a) for a in jax.tree.leaves(c))
    return 2 * params.shard_bytes(c.state) + (1 if kda_decode.is_ring(cfg, c.conv) else 2) * params.shard_bytes(c.conv)


def block_bytes(cfg: KimiK3Config, weights: Weights, cache: Cache, batch: int, first: int = 0) -> dict[str, int]:
    """Bytes one rank's step reads per census block (`block_names`): each block's own weights as
    `weight_bytes_per_rank` counts them (routed experts: the distinct ones a step is expected to touch; the
    embedding: the looked-up rows), an attention block also its layer's cache (`layer_cache_bytes`).
    Weights in the checkpoint layout (the serving layout joins the same bytes)."""
    tp = weights.embed_tokens.sharding.mesh.shape[TP]
    tree = abstract_weights(cfg, tp)
    touched = expected_experts(cfg.num_experts, cfg.num_experts_per_token, batch)

    def count(t, w) -> int:
        return sum(params.bytes_per_rank(t, w, experts_touched=touched, rows=batch).values())

    def fields(x, *names):
        return tuple(getattr(x, n) for n in names)
    head = ("lm_head", "norm", "output_attn_res_norm", "output_attn_res_proj")
    out = {"embed": count(tree.embed_tokens, weights.embed_tokens), "head": count(fields(tree, *head),
                                                                               fields(weights, *head))}
    attn_f = ("attn", "input_layernorm", "self_attention_res_norm", "self_attention_res_proj")
    ffn_f = ("ffn", "post_attention_layernorm", "mlp_res_norm", "mlp_res_proj")
    for l, (attn, ffn) in enumerate(zip(cfg.layer_attn, cfg.layer_ffn)):
        t, w, cb = tree.layers[l], weights.layers[l], layer_cache_bytes(cfg, cache.layers[l])
        out[f"layer{first + l}_{attn}"] = count(fields(t, *attn_f), fields(w, *attn_f)) + cb
        out[f"layer{first + l}_{ffn}"] = count(fields(t, *ffn_f), fields(w, *ffn_f))
    return out


def copy_bandwidth(mesh, nbytes: int = 1 << 30, repeats: int = 7, calls: int = 10) -> float:
    """Bytes/s per device of `a + 1` over an nbytes (per device) f32 array: (read + write) / time."""
    tp = mesh.shape[TP]
    cols = max(1, nbytes // 4)
    x = jax.jit(lambda: jnp.zeros((tp, cols), jnp.float32), out_shardings=NamedSharding(mesh, P(TP)))()
    f = jax.jit(lambda a: a + 1.0)
    y = f(x)
    jax.block_until_ready(y)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            y = f(x)
        jax.block_until_ready(y)
        times.append((time.perf_counter() - t0) / calls)
    del x, y
    return 2 * cols * 4 / statistics.median(times)


# ------------------------------------------------------------------------- HLO census
def hlo_census(text: str) -> dict[str, Any]:
    """Top-level ops of the optimized HLO's ENTRY computation (≈ kernels/launches per step)."""
    entry = text[text.index("ENTRY"):] if "ENTRY" in text else text
    entry = entry[:entry.find("\n}") + 1] if "\n}" in entry else entry
    ops: Counter = Counter()
    targets: Counter = Counter()
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(", line)
        if not m:
            continue
        op = m.group(1)
        if op in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            continue
        ops[op] += 1
        t = re.search(r'custom_call_target="([^"]+)"', line)
        if t:
            targets[t.group(1)] += 1
    gathers_in_fusions = len(re.findall(r"\bgather\(", text))
    return {"ops": dict(ops.most_common()), "custom_call_targets": dict(targets), "launch_ops": sum(ops.values()),
            "gather_ops_in_module": gathers_in_fusions}


# ------------------------------------------------------------------------------ the run
@dataclasses.dataclass
class DecodeRow:
    strategy: str
    batch: int
    context: int
    us_per_step: float  # steps enqueued back to back, median over repeats
    us_spread: tuple[float, float]
    us_per_step_synced: float  # each step waited for
    weight_bytes: int
    cache_bytes: int
    floor_us_weights: float
    floor_us: float  # (weights + caches) / copy bandwidth
    ratio_to_floor: float
    compile_s: float
    logits_rel_diff: float  # first step's logits vs the first strategy's, max|a-b| / max|b|
    gathers: dict
    tokens: list
    census: dict
    # per check step, the smallest over the rows of (top logit - second) / max|logit|: where it is near float32
    # rounding, another summation order (another process's autotuned GEMM tiles) may pick the other token
    top2_margin: list = dataclasses.field(default_factory=list)
    # the check steps run a second time, from a second copy of the same random cache and first tokens: whether every
    # step's logits came out bitwise the same (False: something in the step is not deterministic, e.g. a race)
    rerun_equal: bool | None = None


def _setup(config: str, layers: str | None, experts: int | None, tp: int, batches, strategies,
           target: str | None = None):
    """(full config, first, last, slice config, mesh) of a bench run; ValueError for a bad option.  `target`: the
    mesh is `tp` described devices of that kind (jaxk3.tools.aot), compiled for and never run."""
    full = load_config(config)
    first, last = parse_layers(layers, full)
    cfg = slice_config(full, first, last, experts)
    devs = jax.devices()
    if target is not None:
        mesh = aot.target_mesh(target, tp)
    elif jax.process_count() > 1:
        # jax.distributed: TP over each process's devices, the batch split over dp (processes).
        from jaxk3 import distributed

        mesh = distributed.make_mesh(tp)
        bad = [b for b in batches if b % mesh.shape[DP]]
        if bad:
            raise ValueError(f"--batch {bad}: must split evenly over dp={mesh.shape[DP]}")
    else:
        if not 1 <= tp <= len(devs):
            raise ValueError(f"--tp {tp}: only {len(devs)} devices present")
        mesh = jax.sharding.Mesh(np.asarray(devs[:tp]), (TP,))
    kept = []
    for s in strategies:
        try:
            dataclasses.replace(cfg, experts_format=s.experts).validate_tp(tp, shard_latent=s.shard_latent)
            kept.append(s)
        except ValueError as e:
            if not (s.experts == "mxfp4" and strategies is STRATEGIES):
                raise ValueError(f"strategy {s.name}: {e}") from None
            print(f"  .. strategy {s.name} left out: {e}", file=sys.stderr, flush=True)  # a default that cannot fit
    return full, first, last, cfg, mesh, tuple(kept)


class _Weights:
    """Each strategy's weights, made once per (experts format) and relaid per shard_latent."""

    def __init__(self, cfg: KimiK3Config, mesh, dtype):
        self.cfg, self.mesh, self.dtype, self.made = cfg, mesh, dtype, {}
        self.f16: dict[str, bool] = {}  # experts format -> experts_f16 as a load marks it (its weights made)

    def config(self, s: Strategy) -> KimiK3Config:
        return dataclasses.replace(self.cfg, experts_format=s.experts, experts_f16=self.f16.get(s.experts, False))

    def serving(self, s: Strategy) -> bool:
        return resolve_layout(s.layout, self.mesh.devices.flat[0].platform)

    def step_weights(self, s: Strategy) -> Weights:
        """The strategy's weights in its layout (the serving layout made once per weights and kept)."""
        if not self.serving(s):
            return self.get(s)
        key = ("served", s.experts, s.shard_latent)
        if key not in self.made:
            self.made[key] = serve_weights(self.get(s), self.mesh)
        return self.made[key]

    def get(self, s: Strategy) -> Weights:
        """The strategy's weights in the checkpoint layout (its byte counts are the served ones too)."""
        key = (s.experts, s.shard_latent)
        if key not in self.made:
            base = self.made.get((s.experts, True))
            if base is None:  # the MXFP4 stacks marked as the loader marks them (checkpoint.mark_experts_f16)
                cfg, base = checkpoint.mark_experts_f16(
                    self.config(s), random_weights(self.config(s), self.mesh, self.dtype, shard_latent=True))
                self.f16[s.experts], self.made[(s.experts, True)] = cfg.experts_f16, base
            cfg = self.config(s)
            if not s.shard_latent:
                self.made[key] = relayout_latent(cfg, base, self.mesh, False)
        return self.made[key]


class AbstractWeights(_Weights):
    """`_Weights` as jax.ShapeDtypeStructs on a target mesh (`jaxk3.tools.aot`): the same shapes, dtypes and
    shardings, the MXFP4 stacks marked as the loader marks the random ones (`random_scales_f16`)."""

    def step_weights(self, s: Strategy) -> Weights:
        w = self.get(s)
        return params.serve_abstract(w) if self.serving(s) else w

    def get(self, s: Strategy) -> Weights:
        key = (s.experts, s.shard_latent)
        if key not in self.made:
            self.f16[s.experts] = s.experts == "mxfp4" and random_scales_f16()
            cfg = self.config(s)
            w = params.abstract_on(abstract_weights(cfg, self.mesh.shape[TP]), self.mesh, self.dtype, s.shard_latent)
            self.made[key] = with_f16(w, cfg.experts_f16) if s.experts == "mxfp4" else w
        return self.made[key]


def random_scales_f16() -> bool:
    """Whether `random_weights`' MXFP4 scale bytes (params.E8M0_RANGE, the upper bound excluded) all lie in the
    float16-exact range, so that `checkpoint.mark_experts_f16` marks its stacks."""
    lo, hi = params.E8M0_RANGE["e8m0"]
    return F16_SCALES[0] <= lo and hi - 1 <= F16_SCALES[1]


def abstract_cache(cfg: KimiK3Config, mesh, dtype, batch: int, context: int) -> Cache:
    """`random_cache`'s arrays as jax.ShapeDtypeStructs on `mesh`."""
    abstract = cache_abstract(cfg, batch, context)
    specs = params.buffer_specs(abstract, dp_axis(mesh))

    def one(b: params.Buffer, spec):
        return jax.ShapeDtypeStruct(b.shape, b.np_dtype(dtype), sharding=NamedSharding(mesh, spec))

    return jax.tree.map(one, abstract, specs, is_leaf=params.is_buffer)


def _case(cfg: KimiK3Config, made: _Weights, mesh, dtype, first: int, batch: int, context: int, s: Strategy,
          announce) -> tuple:
    """One (batch, context, strategy) of a run: (the gather impl and its paths, the strategy's weights,
    its jitted step, a random cache, the first token ids, the valid mask).  `announce(gather)` is
    called once the gather impl is known, before any weights or cache are made.  With `AbstractWeights`
    (a target mesh) the weights, cache, ids and mask are jax.ShapeDtypeStructs, to lower and compile only."""
    g, paths = _strategy_gather(cfg, mesh, batch, s.gather, s.shard_latent)
    announce(g)
    weights = made.step_weights(s)
    step = build_step(made.config(s), StepOptions(gather=g, shard_latent=s.shard_latent, layer_offset=first,
                                                  kernels=s.kernels, serving=made.serving(s)), mesh)
    if isinstance(made, AbstractWeights):
        row = NamedSharding(mesh, P(dp_axis(mesh)))
        return (g, paths, weights, step, abstract_cache(cfg, mesh, dtype, batch, context),
                jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=row), jax.ShapeDtypeStruct((batch,), jnp.bool_,
                                                                                           sharding=row))
    cache = random_cache(cfg, mesh, dtype, batch, context)
    ids = put_batch(np.arange(batch, dtype=np.int32) % cfg.vocab_size, mesh)
    valid = put_batch(np.ones((batch,), bool), mesh)
    return g, paths, weights, step, cache, ids, valid


def _strategy_gather(cfg, mesh, batch: int, gather: str, latent: bool) -> tuple[str, dict[str, str]]:
    """The gather impl a strategy runs with ("ffi" becomes "auto" where a gather does not fit) and its paths."""
    g = gather
    if g == "ffi":
        paths = _gather_paths(cfg, mesh, batch, "ffi", latent)
        if not all(p.startswith("ffi") for p in paths.values()):
            g = "auto"  # latent gather one-shot; a gather that does not fit takes lax
    return g, _gather_paths(cfg, mesh, batch, g, latent)


def _gather_paths(cfg, mesh, batch, gather, shard_latent) -> dict[str, str]:
    tp = mesh.shape[TP]
    out = {}
    if shard_latent and cfg.mla_layers:
        w = ((cfg.q_lora_rank or 0) + cfg.latent_dim) // tp
        out["latent"] = str(collectives.explain(jax.ShapeDtypeStruct((batch, w), jnp.bfloat16), TP, axis=-1,
                                                tiled=True, impl=gather, padded=True, mesh=mesh))
    out["logits"] = str(collectives.explain(jax.ShapeDtypeStruct((batch, cfg.padded_vocab(tp) // tp), jnp.float32),
                                            TP, axis=-1, tiled=True, impl=gather, padded=True, mesh=mesh))
    return out


def _file_part(name: str) -> str:
    """A strategy's name as part of a file name: 'stock[serving/auto]' -> 'stock_serving_auto_'."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def bench_decode(config: str = "k3", layers: str | None = "11-14", experts: int | None = 32, tp: int = 2,
                 batches=(1, 8), contexts=(4096, 32768), dtype: str = "bfloat16", steps: int = 20, repeats: int = 5,
                 synced: int = 20, check_tokens: int = 4, copy_bytes: int = 1 << 30, strategies=STRATEGIES,
                 hlo_dir: str | None = None, progress=None) -> dict:
    full, first, last, cfg, mesh, strategies = _setup(config, layers, experts, tp, batches, strategies)
    devs = jax.devices()
    say = progress or (lambda m: None)
    say(f"copy bandwidth ({copy_bytes >> 20} MiB per device)")
    bw = copy_bandwidth(mesh, copy_bytes)
    say("random weights on the devices")
    t0 = time.perf_counter()
    made = _Weights(cfg, mesh, dtype)
    jax.block_until_ready([made.step_weights(s) for s in strategies])
    init_s = time.perf_counter() - t0
    rows: list[DecodeRow] = []
    notes = []
    first_logits: dict[tuple[int, int], np.ndarray] = {}
    for batch in batches:
        for context in contexts:
            for s in strategies:
                name = s.name
                g, paths, weights, step, cache, ids, valid = _case(cfg, made, mesh, dtype, first, batch, context, s,
                                                                   lambda g: say(f"B={batch} S={context} {name} "
                                                                                 f"(gather={g})"))
                t0 = time.perf_counter()
                compiled = step.lower(weights, cache, ids, valid).compile()
                compile_s = time.perf_counter() - t0
                census = hlo_census(compiled.as_text())
                if hlo_dir:
                    os.makedirs(hlo_dir, exist_ok=True)
                    with open(os.path.join(hlo_dir, f"decode_{_file_part(name)}_B{batch}_S{context}.hlo.txt"), "w") as fh:
                        fh.write(compiled.as_text())
                cbytes = cache_bytes_per_rank(cfg, cache)
                tokens, margins, seen = [], [], []
                again = random_cache(cfg, mesh, dtype, batch, context), ids  # the same cache, for the rerun
                for i in range(max(check_tokens, 2)):  # warm-up; the first greedy tokens, for the comparison
                    logits, ids, cache = compiled(weights, cache, ids, valid)
                    tokens.append(to_host(ids).tolist())
                    lg = to_host(logits).astype(np.float32)
                    seen.append(lg)
                    margins.append(top2_margin(lg))
                    if i == 0:
                        ref = first_logits.setdefault((batch, context, s.experts), lg)
                        rel = float(np.max(np.abs(lg - ref)) / max(np.max(np.abs(ref)), 1e-30))
                del logits
                c2, i2 = again
                rerun_equal = True
                for lg in seen:
                    l2, i2, c2 = compiled(weights, c2, i2, valid)
                    rerun_equal &= bool(np.array_equal(to_host(l2).astype(np.float32), lg))
                del again, c2, i2, l2, seen
                per = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        _, ids, cache = compiled(weights, cache, ids, valid)
                    ids.block_until_ready()
                    per.append((time.perf_counter() - t0) / steps * 1e6)
                sync = []
                for _ in range(synced):
                    t0 = time.perf_counter()
                    _, ids, cache = compiled(weights, cache, ids, valid)
                    ids.block_until_ready()
                    sync.append((time.perf_counter() - t0) * 1e6)
                del cache
                parts = weight_bytes_per_rank(made.config(s), made.get(s), batch)
                wbytes = sum(parts.values())
                floor_w = wbytes / bw * 1e6
                floor = (wbytes + cbytes) / bw * 1e6
                med = statistics.median(per)
                rows.append(DecodeRow(name, batch, context, med, (min(per), max(per)),
                                      statistics.median(sync) if sync else float("nan"), wbytes, cbytes, floor_w,
                                      floor, med / floor, compile_s, rel, paths, tokens, census, margins,
                                      rerun_equal))
                rows[-1].census["weight_bytes_by_part"] = parts
                say(f"   -> {med:.1f} us/step (synced {rows[-1].us_per_step_synced:.1f}), floor {floor:.1f} us "
                    f"({wbytes / 1e6:.1f} MB weights + {cbytes / 1e6:.1f} MB cache per rank), x{med / floor:.2f}, "
                    f"compile {compile_s:.1f} s, {census['launch_ops']} top-level ops, first-step logits vs "
                    f"{strategies[0][0]} {rel:.1e}, gathers {paths}, rerun bitwise {rerun_equal}")
    notes += [f"B={r.batch} S={r.context} {r.strategy}: the check steps run again from the same cache gave other "
              f"logits: the step is not deterministic" for r in rows if r.rerun_equal is False]
    for batch in batches:
        for context in contexts:
            dense = {s.name for s in strategies if s.experts == "dense"}  # the same weights: the same tokens
            toks = {r.strategy: r.tokens for r in rows if r.batch == batch and r.context == context
                    and r.strategy in dense}
            if len({json.dumps(t) for t in toks.values()}) > 1:
                rels = {r.strategy: r.logits_rel_diff for r in rows if r.batch == batch and r.context == context}
                notes.append(f"B={batch} S={context}: the strategies' first greedy tokens differ: {toks}; "
                             f"first-step logits max|diff|/max|ref| vs {strategies[0][0]}: {rels}")
    approx = []
    if experts is not None and experts != full.num_experts:
        approx.append(f"routed experts reduced {full.num_experts} -> {cfg.num_experts} for memory; a step reads only "
                      f"the top-{cfg.num_experts_per_token} selected experts per token, so the per-token work is "
                      f"unchanged (byte count: the expected distinct experts, E*(1-(1-k/E)^B))")
    if first and cfg.attn_res_block_size:
        approx.append(f"layer offset {first}: AttnRes schedule by global index; the "
                      f"{-(-first // cfg.attn_res_block_size)} block snapshot(s) before the slice and the running "
                      "partial sum are the embedding (same shapes, same work)")
    approx.append("random weights and random caches of the real shapes; embedding + lm_head (full vocab) included")
    return {
        "kind": "decode",
        "config": config,
        "slice": describe_slice(cfg, first, last),
        "layers": [first, last],
        "experts": cfg.num_experts,
        "tp": tp,
        "dtype": jnp.dtype(dtype).name,
        "devices": tp,
        "platform": devs[0].platform,
        "device_kind": devs[0].device_kind,
        "copy_bandwidth_GBps": bw / 1e9,
        "weights_init_s": init_s,
        "steps": steps,
        "repeats": repeats,
        "approximations": approx,
        "notes": notes,
        "versions": _versions(),
        "rows": [dataclasses.asdict(r) for r in rows],
    }


# ------------------------------------------------------------------------ kernel census
def block_names(cfg: KimiK3Config, first: int = 0) -> list[str]:
    """The step's named-scope blocks in program order (model.forward_local): embed, then per layer
    f"layer{g}_{kda|mla}" and f"layer{g}_{moe|mlp}" with g the global index, then head."""
    layers = [f"layer{first + l}_{kind}" for l, pair in enumerate(zip(cfg.layer_attn, cfg.layer_ffn)) for kind in pair]
    return ["embed", *layers, "head"]


def command_buffers() -> str:
    """XLA's GPU command buffers as this process's XLA_FLAGS set them: "off" (`--xla_gpu_enable_command_buffer=`
    with no command types), "on (<types>)" where the flag names them, else "on (XLA's default)"."""
    m = re.findall(r"--xla_gpu_enable_command_buffer=(\S*)", os.environ.get("XLA_FLAGS", ""))
    if not m:
        return "on (XLA's default)"
    return "off" if m[-1] in ("", "''", '""') else f"on ({m[-1]})"


def _profile(compiled, weights, cache, ids, valid, steps: int, kc: dict
             ) -> tuple[dict | None, str | None, Any, dict | None, str | None]:
    """(times per block, None) or (None, why not) from `steps` steps under jax.profiler.trace, the cache, and the
    GPU's timeline over those steps (census.device_timeline, None) or (None, why not)."""
    import shutil

    trace_dir = tempfile.mkdtemp(prefix="jaxk3_census_")
    try:
        try:
            with jax.profiler.trace(trace_dir):
                for _ in range(steps):
                    _, ids, cache = compiled(weights, cache, ids, valid)
                ids.block_until_ready()
        except Exception as e:  # another trace running, no profiler plugin (CUPTI) on this machine, ...
            why = f"the profiler did not run ({type(e).__name__}: {e})"
            return None, why, cache, None, why
        try:
            path = census.find_xplane(trace_dir)
        except census.ProfileUnavailable as e:
            return None, str(e), cache, None, str(e)
        times = timeline = why = twhy = None
        try:
            times = census.profile_times(path, kc, steps)
        except census.ProfileUnavailable as e:
            why = str(e)
        try:
            timeline = census.device_timeline(path, steps)
        except census.ProfileUnavailable as e:
            twhy = str(e)
        return times, why, cache, timeline, twhy
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def census_decode(config: str = "k3", layers: str | None = "11-14", experts: int | None = 32, tp: int = 2,
                  batches=(1,), contexts=(4096,), dtype: str = "bfloat16", steps: int = 10,
                  strategies=STRATEGIES, hlo_dir: str | None = None, profile: bool = True, progress=None,
                  copy_bytes: int = 1 << 30, target: str | None = None) -> dict:
    """Kernel census of the decode step (`jaxk3 bench decode --census`), per (batch, context, strategy).

    Each row: the compiled step's kernels per block by kind (jaxk3.census.kernel_census of the
    optimized HLO; the blocks are model.forward_local's named scopes) and, with `profile`, the
    device time per block per step from `steps` profiled steps after two warm-up steps
    (census.profile_times), or the reason there is none; and each block's bytes (`block_bytes`) beside the
    copy bandwidth measured once with `profile` (`copy_bytes` per device), so that a block's time reads against its
    floor.  Same setup as `bench_decode` (random weights and caches of the real shapes, the same strategies), no
    latency timing.

    `target` (jaxk3.tools.aot.TARGETS, e.g. "h200"): the step compiled for `tp` devices of that kind that this
    machine does not have (XLA's deviceless compile): the census of the kernels as that device compiles them,
    and a kernel that does not fit it fails here; no profile, weights and caches abstract."""
    full, first, last, cfg, mesh, strategies = _setup(config, layers, experts, tp, batches, strategies, target)
    devs = list(np.asarray(mesh.devices).flat) if target else jax.devices()
    say = progress or (lambda m: None)
    bw = None
    profile = profile and target is None
    if profile:  # only profiled times read against a floor
        say(f"copy bandwidth ({copy_bytes >> 20} MiB per device)")
        bw = copy_bandwidth(mesh, copy_bytes)
    say(f"abstract weights for {tp} x {target}" if target else "random weights on the devices")
    made = (AbstractWeights if target else _Weights)(cfg, mesh, dtype)
    blocks = block_names(cfg, first)
    rows = []
    for batch in batches:
        for context in contexts:
            for s in strategies:
                name = s.name
                g, paths, weights, step, cache, ids, valid = _case(cfg, made, mesh, dtype, first, batch, context, s,
                                                                   lambda g: say(f"census B={batch} S={context} "
                                                                                 f"{name} (gather={g})"))
                launch = None
                if target:  # the thunk sequence too: each kernel's launch as the device would run it
                    with tempfile.TemporaryDirectory(prefix="jaxk3_aot_") as dump:
                        compiled = step.lower(weights, cache, ids, valid).compile(
                            compiler_options=aot.dump_options(dump))
                        launch = aot.launches(dump)
                else:
                    compiled = step.lower(weights, cache, ids, valid).compile()
                text = compiled.as_text()
                if hlo_dir:
                    os.makedirs(hlo_dir, exist_ok=True)
                    with open(os.path.join(hlo_dir, f"census_{_file_part(name)}_B{batch}_S{context}.hlo.txt"),
                              "w") as fh:
                        fh.write(text)
                kc = census.kernel_census(text, blocks)
                nbytes = block_bytes(made.config(s), made.get(s), cache, batch, first)
                times, why = None, (f"compiled for {target}, not run" if target else "not profiled (profile=False)")
                timeline, twhy = None, why
                if profile:
                    for _ in range(2):  # warm-up, finished before the trace starts (else its events count)
                        _, ids, cache = compiled(weights, cache, ids, valid)
                    ids.block_until_ready()
                    times, why, cache, timeline, twhy = _profile(compiled, weights, cache, ids, valid, steps, kc)
                    if timeline:
                        timeline["command_buffers"] = command_buffers()
                del cache
                public = {k: v for k, v in kc.items() if k != "op_block"}
                rows.append({"strategy": name, "batch": batch, "context": context, "gathers": paths, "census": public,
                             "per_layer": census.layer_summary(kc), "profile": times, "profile_unavailable": why,
                             "timeline": timeline, "timeline_unavailable": twhy,
                             "bytes": nbytes, "launch_ops": hlo_census(text)["launch_ops"]})
                if launch is not None:  # each kernel's launch as the target runs it, with its census block
                    rows[-1]["launches"] = [dict(x, block=kc["kernel_names"].get(x["name"])) for x in launch]
                say(f"   -> {kc['total']} kernels per step" + (f", {times['total_us']:.1f} us summed over its op events per "
                                                               f"step" if times else f"; profile times unavailable: {why}"))
    platform = devs[0].platform
    notes = []
    if target:
        notes.append(f"compiled for {tp} x {target} without one (jaxk3.tools.aot, jax {jax.__version__}): the "
                     f"device's kernels as its XLA fuses them (launch ops matched the H200's census at jax 0.11.2), "
                     f"no times; GEMM fusions take XLA's default tiles (no autotuning)")
    elif platform == "cpu":
        notes.append("CPU: the census counts the CPU HLO's kernels (its ENTRY ops, run as thunks on a thread pool), "
                     "not GPU kernels; the same step fuses differently on GPU")
    elif platform in ("gpu", "cuda", "rocm"):
        notes.append("GPU: kernels replayed inside a CUDA graph (XLA command buffers, on by default) carry the "
                     "graph's name (command_buffer_N), not their op's, so their time is unplaced; "
                     "XLA_FLAGS=--xla_gpu_enable_command_buffer= gives every kernel its own (kernel counts are the "
                     "same either way)")
    return {"kind": "decode_census", "config": config, "slice": describe_slice(cfg, first, last), "layers": [first, last],
            "experts": cfg.num_experts, "tp": tp, "dtype": jnp.dtype(dtype).name, "platform": platform,
            "device_kind": devs[0].device_kind, "steps": steps, "blocks": blocks, "notes": notes, "target": target,
            "sm_count": getattr(devs[0], "core_count", None),
            "copy_bandwidth_GBps": bw / 1e9 if bw else None, "versions": _versions(), "rows": rows}


def census_report(result: dict) -> str:
    """The census as text: one table per (config, batch, context, strategy), then the notes."""
    out = [f"kernel census of the decode step: {result['config']} {result['slice']}, {result['experts']} routed "
           f"experts, TP {result['tp']} x {result['device_kind']} ({result['platform']}), {result['dtype']}, "
           f"jax {result['versions']['jax']}"]
    for r in result["rows"]:
        title = (f"\n== {result['config']}, B={r['batch']}, context {r['context']}, {r['strategy']} "
                 f"(module {r['census']['module']}; {r['launch_ops']} launch ops, as `bench decode` counts them)")
        out.append(census.census_table(r["census"], r["profile"], title, r["profile_unavailable"], r.get("bytes"),
                                       result.get("copy_bandwidth_GBps")))
        if r.get("launches"):
            out.append(launch_summary(r["launches"], result.get("sm_count")))
        if "timeline" in r:  # (not in a JSON from before it existed)
            out.append(census.timeline_line(r["timeline"], r.get("timeline_unavailable")))
    out += [f"note: {n}" for n in result["notes"]]
    return "\n".join(out)


def kernel_name(launch: dict) -> str:
    """A launch's kernel name (aot.launches) without the numeric suffixes XLA gives repeated kernels (`gemv_norm__2`)."""
    return re.sub(r"(_+\d+)+$", "", launch["kernel"])


def launch_summary(launches: list[dict], sms: int | None) -> str:
    """One paragraph on a target census's launches (aot.launches): how many, and those of fewer CTAs than the
    device has SMs (they leave SMs idle: latency-bound unless each CTA is long), grouped by kernel and CTAs."""
    sms = sms or 132
    kernels = [x for x in launches if "ctas" in x]
    others = Counter(x["kind"] for x in launches if "ctas" not in x)
    small = Counter((x["block"] or "?").split("_")[-1] + ":" + kernel_name(x)
                    + f"({x['ctas']}x{x['threads']})" for x in kernels if x["ctas"] < sms)
    smem = max((x["shared_memory"] for x in kernels), default=0)
    top = small.most_common(12)
    more = f", and {len(small) - len(top)} more kinds" if len(small) > len(top) else ""
    rest = (" and " + ", ".join(f"{n} {k}" for k, n in others.most_common())) if others else ""
    return (f"launches (XLA's thunk sequence for the target): {len(kernels)} kernels XLA launches{rest}; the most "
            f"shared memory at launch {smem} B; {sum(small.values())} kernels of fewer CTAs than its {sms} SMs, by "
            f"block kind:kernel(CTAs x threads): " + ", ".join(f"{k} x{n}" for k, n in top) + more)


def _versions() -> dict:
    from jaxk3.tools import bench_gather as bench

    return bench.versions()


def decode_table(result: dict) -> str:
    head = (f"{'B':>3} | {'ctx':>6} | {'strategy':<22} | {'us/step':>8} | {'synced':>8} | {'wMB/rank':>8} | "
            f"{'cacheMB':>7} | {'floor us':>8} | {'x floor':>7} | {'vs first':>8} | {'launch ops':>10} | gathers")
    lines = [
        f"decode step: {result['slice']}, {result['experts']} routed experts, TP {result['tp']} x "
        f"{result['device_kind']} ({result['platform']}), {result['dtype']}, jax {result['versions']['jax']}",
        f"copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s per device (read+write); floor = (weight + cache "
        f"bytes per rank) / that; us/step = median of {result['repeats']} x {result['steps']} back-to-back steps",
        head, "-" * len(head)]
    base = result["rows"][0]["strategy"] if result["rows"] else None  # the first strategy: the baseline of "vs"
    stock = {(r["batch"], r["context"]): r["us_per_step"] for r in result["rows"] if r["strategy"] == base}
    for r in result["rows"]:
        s = stock.get((r["batch"], r["context"]))
        vs = f"{s / r['us_per_step']:>7.3f}x" if s else f"{'-':>8}"
        g = ", ".join(f"{k}:{v.split(':')[0].split(' ')[0]}" for k, v in r["gathers"].items())
        lines.append(f"{r['batch']:>3} | {r['context']:>6} | {r['strategy']:<22} | {r['us_per_step']:>8.1f} | "
                     f"{r['us_per_step_synced']:>8.1f} | {r['weight_bytes'] / 1e6:>8.1f} | {r['cache_bytes'] / 1e6:>7.1f} | "
                     f"{r['floor_us']:>8.1f} | {r['ratio_to_floor']:>7.2f} | {vs} | {r['census']['launch_ops']:>10} | {g}")
    for a in result["approximations"]:
        lines.append(f"note: {a}")
    for n in result["notes"]:
        lines.append(f"NOTE: {n}")
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["batch"], r["context"]) for r in result["rows"]})
    names = [s.name for s in STRATEGIES if any(r["strategy"] == s.name for r in result["rows"])]
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(keys)), 4))
    for i, name in enumerate(names):
        ys = [next((r["us_per_step"] for r in result["rows"] if r["strategy"] == name and (r["batch"], r["context"]) == k),
                   float("nan")) / 1e3 for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], ys, width, label=name)
    floors = [next(r["floor_us"] for r in result["rows"] if (r["batch"], r["context"]) == k) / 1e3 for k in keys]
    for j, f in enumerate(floors):
        ax.hlines(f, j - width / 2, j + width * (len(names) - 0.5), colors="k", linestyles="dashed",
                  label="bandwidth floor" if j == 0 else None)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"B={b}\nctx={c}" for b, c in keys])
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{result['slice'].split(' [')[0]}, TP{result['tp']} {result['device_kind']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
