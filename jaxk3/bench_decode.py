"""`jaxk3 bench decode`: one decode step of a layer slice, three latent strategies, same run.

Strategies (same random weights, same random caches, same tokens):

  stock             q_a_proj / kv_a_proj_with_mqa replicated (shard_latent=False), gathers via lax
  sharded+lax       latent projections split by rows, one lax.all_gather per MLA layer
  sharded+one-shot  the same split, the one-shot FFI gather (the logits gather takes the FFI
                    path too where it fits under JAXK3_GATHER_MAX_BYTES, lax above; recorded)

For each (batch, MLA context) and strategy: the median step latency over many steps after
warm-up (steps enqueued back to back with the cache donated, the greedy token fed back on
device, wall time / steps; and, separately, each step synchronised), the bytes each rank reads
per step (weights counted from the per-device shard sizes of the placed arrays, routed experts
only for the min(E, B*k) experts a step can touch, the embedding only for its B rows; caches
separately), the device's measured copy bandwidth (a large device-to-device copy: read +
write bytes / time), the floor bytes / bandwidth, and the ratio to it.

Layer slice.  `--layers 11-14` keeps those (0-based, spec §1.2) layers of the config with their
kinds (K3: 11 MLA, 12-14 KDA, all MoE).  The step runs them with their global layer index for
the AttnRes schedule (a block starts where global l % 12 == 0, so 12 starts one), through a
copy of model.forward_local's K3 loop in this file with a layer offset; the completed-block
snapshots before the slice, and the running partial sum, are stood in for by the embedding
(same shapes, so the same work).  With offset 0 the model's own forward_local runs.
The embedding and lm_head (vocab-parallel, full vocab) are part of the step.

`--experts N` keeps N routed experts per MoE layer (memory): a decode step reads only the top-k
selected experts (`jnp.take`), so the per-token work is unchanged as long as N >= B*k; the byte
count uses min(N, B*k) experts.  Weights are random, generated on the devices, already sharded.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import statistics
import time
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxk3 import collectives
from jaxk3 import sharding as shd
from jaxk3._compat import shard_map
from jaxk3.config import KimiK3Config
from jaxk3.layers.kda import KDAWeights
from jaxk3.layers.mla import MLAWeights
from jaxk3.layers.moe import MLPWeights, MoEWeights
from jaxk3.model import (Cache, LayerWeights, StepOptions, Weights, _attn_fields, _to_host, cache_shapes, dp_axis,
                         forward_local, put_batch)

# name, shard_latent, gather
STRATEGIES = (("stock", False, "lax"), ("sharded+lax", True, "lax"), ("sharded+one-shot", True, "ffi"))
EXPERT_KEYS = ("moe.experts_w1", "moe.experts_w2", "moe.experts_w3")


# ------------------------------------------------------------------------------ config
def load_config(name: str) -> KimiK3Config:
    if name == "k3":
        return KimiK3Config.k3()
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


# -------------------------------------------------------------------- the step, offset
def make_step(cfg: KimiK3Config, offset: int, weights: Weights, mesh, gather: str, shard_latent: bool):
    """jit(step)(weights, cache, tokens_B, valid_B) -> (logits, ids, cache), cache donated (as Model).

    `offset`: the global index of the slice's first layer (model.StepOptions.layer_offset)."""
    opt = StepOptions(tp_axis=shd.TP, gather=gather, shard_latent=shard_latent, layer_offset=offset)
    fwd = functools.partial(forward_local, cfg, opt)
    dp = dp_axis(mesh)
    cspecs = Cache(**shd.cache_specs(dp))
    local = shard_map(fwd, mesh, in_specs=(shd.weight_specs(weights, shard_latent), cspecs, P(dp), P(dp)),
                      out_specs=(P(dp), cspecs))

    def step(weights, cache, tokens_B, valid_B):
        logits_BV, cache = local(weights, cache, tokens_B, valid_B)
        return logits_BV, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), cache

    return jax.jit(step, donate_argnames=("cache",))


# ----------------------------------------------------------------- random device arrays
class _Leaf:
    """A weight's global shape, before it exists (sharding.map_weights treats it as a leaf)."""

    def __init__(self, *shape: int):
        self.shape = tuple(shape)


def weight_skeleton(cfg: KimiK3Config, tp: int) -> Weights:
    """The Weights pytree of `cfg` with _Leaf shapes (vocab tables padded for tp), as weights_from_hf builds it."""
    D, V = cfg.hidden_size, cfg.padded_vocab(tp)
    S = _Leaf
    layers = []
    for l in range(cfg.num_hidden_layers):
        kind = cfg.layer_attn[l]
        fields = {f: (S(cfg.kda_num_heads) if f == "A_log" else S(*shape))
                  for f, (shape, _) in _attn_fields(cfg, kind).items()}
        attn = (KDAWeights if kind == "kda" else MLAWeights)(**fields)
        if cfg.layer_ffn[l] == "mlp":
            I = cfg.intermediate_size
            ffn = MLPWeights(gate_proj=S(I, D), up_proj=S(I, D), down_proj=S(D, I))
        else:
            E, I, L = cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_hidden
            Is = cfg.shared_intermediate_size
            latent = cfg.routed_expert_hidden_size is not None
            ffn = MoEWeights(
                gate=S(E, D), e_score_correction_bias=S(E), experts_w1=S(E, I, L), experts_w2=S(E, L, I),
                experts_w3=S(E, I, L),
                shared_experts=MLPWeights(S(Is, D), S(Is, D), S(D, Is)) if cfg.num_shared_experts else None,
                routed_expert_down_proj=S(L, D) if latent else None, routed_expert_norm=S(L) if latent else None,
                routed_expert_up_proj=S(D, L) if latent else None)
        res = {}
        if cfg.attn_res_block_size is not None:
            res = dict(self_attention_res_norm=S(D), self_attention_res_proj=S(1, D), mlp_res_norm=S(D),
                       mlp_res_proj=S(1, D))
        layers.append(LayerWeights(attn=attn, ffn=ffn, input_layernorm=S(D), post_attention_layernorm=S(D), **res))
    top = {}
    if cfg.attn_res_block_size is not None:
        top = dict(output_attn_res_norm=S(D), output_attn_res_proj=S(1, D))
    return Weights(embed_tokens=S(V, D), lm_head=S(V, D), norm=S(D), layers=tuple(layers), **top)


def _init_kind(key: str) -> str:
    field = key.split(".", 1)[1]
    if field.endswith("norm"):
        return "norm"
    if field in ("A_log", "dt_bias", "e_score_correction_bias", "embed_tokens", "lm_head"):
        return field
    if field.endswith("conv1d"):
        return "conv"
    if field.endswith("res_proj"):
        return "res"
    return "w"


@functools.lru_cache(maxsize=None)
def _generator(shape: tuple[int, ...], dtype: str, kind: str, sharding, D: int):
    def gen(k):
        if kind == "A_log":
            return jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
        z = jax.random.normal(k, shape, jnp.float32)
        scale, shift = {"norm": (0.1, 1.0), "dt_bias": (1.0, 0.0), "e_score_correction_bias": (0.1, 0.0),
                        "conv": (0.3, 0.0), "embed_tokens": (1.0, 0.0), "lm_head": (D ** -0.5, 0.0),
                        "res": (0.1, 0.0)}.get(kind, (0.02, 0.0))
        return (z * scale + shift).astype(dtype)

    return jax.jit(gen, out_shardings=sharding)


def random_weights(cfg: KimiK3Config, mesh, dtype, shard_latent: bool, seed: int = 0) -> Weights:
    """Random weights (spec §7.1-like scales) generated on the devices in their final sharding."""
    tp = mesh.shape[shd.TP]
    counter = iter(range(1 << 30))
    root = jax.random.key(seed)

    def make(key: str, leaf: _Leaf):
        dt = "float32" if key in shd.FP32_WEIGHTS else jnp.dtype(dtype).name
        sharding = NamedSharding(mesh, shd.spec(key, shard_latent))
        return _generator(leaf.shape, dt, _init_kind(key), sharding, cfg.hidden_size)(
            jax.random.fold_in(root, next(counter)))

    return shd.map_weights(make, weight_skeleton(cfg, tp))


def relayout_latent(weights: Weights, mesh, shard_latent: bool) -> Weights:
    """The same weights with the MLA latent projections placed for `shard_latent` (the rest shared)."""
    def put(key, a):
        if shd.WEIGHT_SPECS[key] == shd.LATENT:
            return jax.device_put(a, NamedSharding(mesh, shd.spec(key, shard_latent)))
        return a

    return shd.map_weights(put, weights)


def random_cache(cfg: KimiK3Config, mesh, dtype, batch: int, context: int, seed: int = 1) -> Cache:
    """Caches filled with random data; every row has context-1 tokens, so the MLA step attends to all."""
    shapes = cache_shapes(cfg, batch, context, dtype)
    scales = {"conv": 0.1, "state": 0.01, "kv": 1.0}
    out = {}
    for i, (name, scale) in enumerate(scales.items()):
        shape, dt = shapes[name]
        f = jax.jit(lambda k, shape=shape, dt=dt, scale=scale: (jax.random.normal(k, shape, jnp.float32) * scale).astype(dt),
                    out_shardings=NamedSharding(mesh, shd.cache_specs(dp_axis(mesh))[name]))
        out[name] = f(jax.random.fold_in(jax.random.key(seed), i))
    out["length"] = put_batch(np.full((batch,), context - 1, np.int32), mesh)
    return Cache(**out)


# --------------------------------------------------------------------------- accounting
def _shard_bytes(a: jax.Array) -> int:
    return math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize


def weight_bytes_per_rank(cfg: KimiK3Config, weights: Weights, batch: int) -> dict[str, int]:
    """Bytes one rank's step must read, by part (largest shard; replicated arrays count in full)."""
    touched = min(cfg.num_experts, batch * cfg.num_experts_per_token)
    parts: Counter = Counter()

    def count(key: str, a):
        b = _shard_bytes(a)
        block = key.split(".")[0]
        if key in EXPERT_KEYS:
            b = b * touched // cfg.num_experts
            part = "moe_experts"
        elif key == "model.embed_tokens":
            b = min(batch, a.shape[0]) * a.sharding.shard_shape(a.shape)[1] * a.dtype.itemsize
            part = "embed"
        elif key == "model.lm_head":
            part = "lm_head"
        elif key in ("mla.q_a_proj", "mla.kv_a_proj_with_mqa"):
            part = "mla_latent"
        else:
            part = {"kda": "kda", "mla": "mla_other", "moe": "moe_other", "mlp": "mlp_and_shared_experts"}.get(block, "other")
        parts[part] += b
        return a

    shd.map_weights(count, weights)
    return dict(parts)


def cache_bytes_per_rank(cfg: KimiK3Config, cache: Cache) -> int:
    """MLA latent cache read once (replicated: every rank reads all of it), KDA state read + written."""
    return _shard_bytes(cache.kv) + 2 * _shard_bytes(cache.state) + 2 * _shard_bytes(cache.conv)


def copy_bandwidth(mesh, nbytes: int = 1 << 30, repeats: int = 7, calls: int = 10) -> float:
    """Bytes/s per device of `a + 1` over an nbytes (per device) f32 array: (read + write) / time."""
    tp = mesh.shape[shd.TP]
    cols = max(1, nbytes // 4)
    x = jax.jit(lambda: jnp.zeros((tp, cols), jnp.float32), out_shardings=NamedSharding(mesh, P(shd.TP)))()
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


def _gather_paths(cfg, mesh, batch, gather, shard_latent) -> dict[str, str]:
    tp = mesh.shape[shd.TP]
    out = {}
    if shard_latent and cfg.mla_layers:
        w = ((cfg.q_lora_rank or 0) + cfg.latent_dim) // tp
        out["latent"] = str(collectives.explain(jax.ShapeDtypeStruct((batch, w), jnp.bfloat16), shd.TP, axis=-1,
                                                tiled=True, impl=gather, padded=True, mesh=mesh))
    out["logits"] = str(collectives.explain(jax.ShapeDtypeStruct((batch, cfg.padded_vocab(tp) // tp), jnp.float32),
                                            shd.TP, axis=-1, tiled=True, impl=gather, padded=True, mesh=mesh))
    return out


def bench_decode(config: str = "k3", layers: str | None = "11-14", experts: int | None = 32, tp: int = 2,
                 batches=(1, 8), contexts=(4096, 32768), dtype: str = "bfloat16", steps: int = 20, repeats: int = 5,
                 synced: int = 20, check_tokens: int = 4, copy_bytes: int = 1 << 30, strategies=STRATEGIES,
                 hlo_dir: str | None = None, progress=None) -> dict:
    full = load_config(config)
    first, last = parse_layers(layers, full)
    cfg = slice_config(full, first, last, experts)
    devs = jax.devices()
    if jax.process_count() > 1:
        # jax.distributed: TP over each process's devices, the batch split over dp (processes).
        from jaxk3 import distributed

        mesh = distributed.make_mesh(tp)
        bad = [b for b in batches if b % mesh.shape[shd.DP]]
        if bad:
            raise ValueError(f"--batch {bad}: must split evenly over dp={mesh.shape[shd.DP]}")
    else:
        if not 1 <= tp <= len(devs):
            raise ValueError(f"--tp {tp}: only {len(devs)} devices present")
        mesh = jax.sharding.Mesh(np.asarray(devs[:tp]), (shd.TP,))
    for _, latent, _ in strategies:
        cfg.validate_tp(tp, shard_latent=latent)
    say = progress or (lambda m: None)
    say(f"copy bandwidth ({copy_bytes >> 20} MiB per device)")
    bw = copy_bandwidth(mesh, copy_bytes)
    say("random weights on the devices")
    t0 = time.perf_counter()
    w_sharded = random_weights(cfg, mesh, dtype, shard_latent=True)
    w_by_latent = {True: w_sharded, False: relayout_latent(w_sharded, mesh, False)}
    jax.block_until_ready(w_by_latent)
    init_s = time.perf_counter() - t0
    rows: list[DecodeRow] = []
    notes = []
    first_logits: dict[tuple[int, int], np.ndarray] = {}
    for batch in batches:
        for context in contexts:
            for name, latent, gather in strategies:
                g = gather
                if g == "ffi":
                    paths = _gather_paths(cfg, mesh, batch, "ffi", latent)
                    if not all(p.startswith("ffi") for p in paths.values()):
                        g = "auto"  # latent gather one-shot; a gather that does not fit takes lax
                paths = _gather_paths(cfg, mesh, batch, g, latent)
                say(f"B={batch} S={context} {name} (gather={g})")
                weights = w_by_latent[latent]
                step = make_step(cfg, first, weights, mesh, g, latent)
                cache = random_cache(cfg, mesh, dtype, batch, context)
                ids = put_batch(np.arange(batch, dtype=np.int32) % cfg.vocab_size, mesh)
                valid = put_batch(np.ones((batch,), bool), mesh)
                t0 = time.perf_counter()
                compiled = step.lower(weights, cache, ids, valid).compile()
                compile_s = time.perf_counter() - t0
                census = hlo_census(compiled.as_text())
                if hlo_dir:
                    os.makedirs(hlo_dir, exist_ok=True)
                    with open(os.path.join(hlo_dir, f"decode_{name.replace('+', '_')}_B{batch}_S{context}.hlo.txt"), "w") as fh:
                        fh.write(compiled.as_text())
                cbytes = cache_bytes_per_rank(cfg, cache)
                tokens = []
                for i in range(max(check_tokens, 2)):  # warm-up; the first greedy tokens, for the comparison
                    logits, ids, cache = compiled(weights, cache, ids, valid)
                    tokens.append(_to_host(ids).tolist())
                    if i == 0:
                        lg = _to_host(logits).astype(np.float32)
                        ref = first_logits.setdefault((batch, context), lg)
                        rel = float(np.max(np.abs(lg - ref)) / max(np.max(np.abs(ref)), 1e-30))
                del logits
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
                parts = weight_bytes_per_rank(cfg, weights, batch)
                wbytes = sum(parts.values())
                floor_w = wbytes / bw * 1e6
                floor = (wbytes + cbytes) / bw * 1e6
                med = statistics.median(per)
                rows.append(DecodeRow(name, batch, context, med, (min(per), max(per)),
                                      statistics.median(sync) if sync else float("nan"), wbytes, cbytes, floor_w,
                                      floor, med / floor, compile_s, rel, paths, tokens, census))
                rows[-1].census["weight_bytes_by_part"] = parts
                say(f"   -> {med:.1f} us/step (synced {rows[-1].us_per_step_synced:.1f}), floor {floor:.1f} us "
                    f"({wbytes / 1e6:.1f} MB weights + {cbytes / 1e6:.1f} MB cache per rank), x{med / floor:.2f}, "
                    f"compile {compile_s:.1f} s, {census['launch_ops']} top-level ops, first-step logits vs "
                    f"{strategies[0][0]} {rel:.1e}, gathers {paths}")
    for batch in batches:
        for context in contexts:
            toks = {r.strategy: r.tokens for r in rows if r.batch == batch and r.context == context}
            if len({json.dumps(t) for t in toks.values()}) > 1:
                rels = {r.strategy: r.logits_rel_diff for r in rows if r.batch == batch and r.context == context}
                notes.append(f"B={batch} S={context}: the strategies' first greedy tokens differ: {toks}; "
                             f"first-step logits max|diff|/max|ref| vs {strategies[0][0]}: {rels}")
    approx = []
    if experts is not None and experts != full.num_experts:
        approx.append(f"routed experts reduced {full.num_experts} -> {cfg.num_experts} for memory; a step reads only "
                      f"the top-{cfg.num_experts_per_token} selected experts per token, so the per-token work is "
                      f"unchanged (byte count: min(E, B*k) experts)")
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


def _versions() -> dict:
    from jaxk3 import bench

    return bench.versions()


def decode_table(result: dict) -> str:
    head = (f"{'B':>3} | {'ctx':>6} | {'strategy':<16} | {'us/step':>8} | {'synced':>8} | {'wMB/rank':>8} | "
            f"{'cacheMB':>7} | {'floor us':>8} | {'x floor':>7} | {'vs stock':>8} | {'launch ops':>10} | gathers")
    lines = [
        f"decode step: {result['slice']}, {result['experts']} routed experts, TP {result['tp']} x "
        f"{result['device_kind']} ({result['platform']}), {result['dtype']}, jax {result['versions']['jax']}",
        f"copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s per device (read+write); floor = (weight + cache "
        f"bytes per rank) / that; us/step = median of {result['repeats']} x {result['steps']} back-to-back steps",
        head, "-" * len(head)]
    stock = {(r["batch"], r["context"]): r["us_per_step"] for r in result["rows"] if r["strategy"] == "stock"}
    for r in result["rows"]:
        s = stock.get((r["batch"], r["context"]))
        vs = f"{s / r['us_per_step']:>7.3f}x" if s else f"{'-':>8}"
        g = ", ".join(f"{k}:{v.split(':')[0].split(' ')[0]}" for k, v in r["gathers"].items())
        lines.append(f"{r['batch']:>3} | {r['context']:>6} | {r['strategy']:<16} | {r['us_per_step']:>8.1f} | "
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
    names = [s for s, _, _ in STRATEGIES if any(r["strategy"] == s for r in result["rows"])]
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
