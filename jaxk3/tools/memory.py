"""Memory: bytes per rank by part, and how many H200s a model needs at each TP x DP layout.

Everything here comes from the abstract weight tree (`model.abstract_weights`: every `Param`'s
shape, dtype class and PartitionSpec) and `KimiK3Config.cache_bytes_per_rank`; nothing is
allocated and no tensor data is read, so the full 93-layer Kimi-K3 is reported instantly on a laptop.

    weight_bytes_per_rank  HBM one TP rank holds for the weights, by Param.group (every expert)
    step_bytes_per_rank    bytes one rank reads per decode step at batch B (min(E, B*k) of the E
                           experts, B embedding rows), as `params.bytes_per_rank` counts placed weights
    cache_bytes            the decode cache one rank holds (KimiK3Config.cache_bytes_per_rank)
    layouts / min_gpus     per (TP, DP): weights + cache per rank against the usable HBM
    info / report          the JSON-able dict and the text `jaxk3 info --tp N` prints
    checkpoint_config      a checkpoint directory's config with its experts format, from config.json
                           and the safetensors headers only

A rank's shard of a weight: each dimension its PartitionSpec splits over "tp" is ceil-divided by
tp, the others are whole (replicated weights in full; the "dp" axis never splits a weight).  Bytes
per element: "uint8" Params (MXFP4 packed nibbles and E8M0 scales) 1, "fp32" Params 4, "compute"
Params the model dtype's (2 for bfloat16).

Usable HBM: an H200 has 141 GB (`H200_HBM_BYTES`: NVIDIA's figure, taken as 141e9 bytes; what
JAX's allocator may use on a real H200 was not measured here); `DEFAULT_RESERVE` (10%) of it is kept back for
activations, XLA's workspace and fragmentation, so a layout "fits" when weights + cache per rank
<= 0.9 x 141e9 = 126.9e9 bytes.  JAX preallocates only 75% of a GPU by default: a layout that
needs more than 105.75e9 bytes per rank runs with XLA_PYTHON_CLIENT_MEM_FRACTION raised (e.g. 0.95).

Across hosts (TP x DP > 8): jaxk3 runs on `jax.distributed` (jaxk3.distributed, docs/DISTRIBUTED.md),
one process per host.  `distributed.make_mesh(tp)` keeps each TP group inside one process (tp must
divide the process's device count) and puts DP across hosts.  TP above the GPUs of one host needs
a mesh built by hand over `jax.devices()` (e.g. `Mesh(np.asarray(jax.devices()).reshape(-1, 16),
("dp", "tp"))`, passed as `mesh=`); its collectives then span processes, and `collectives.plan`
sends every such gather and psum to XLA's own collectives (`lax`, NCCL between GPUs), never the
FFI one-shot path, which is single-process only.  Tested on CPU (gloo, 2 processes), not on GPUs.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable

from jaxk3 import params
from jaxk3.config import KimiK3Config
from jaxk3.sharding import TP

GROUPS = ("kda", "mla_latent", "mla_other", "moe_experts", "moe_latent", "moe_other", "mlp",
          "mlp_and_shared_experts", "embed", "lm_head", "other")
H200_HBM_BYTES = 141_000_000_000  # NVIDIA's "141 GB" HBM3e per H200
DEFAULT_RESERVE = 0.10  # kept back for activations, XLA workspace, fragmentation
GPUS_PER_HOST = 8
DEFAULT_BATCH = 1
DEFAULT_CONTEXT = 8192
GB = 1e9

CROSS_HOST_NOTE = (
    "TP x DP beyond one host runs on jax.distributed, one process per host (docs/DISTRIBUTED.md). "
    "distributed.make_mesh(tp) keeps each TP group inside a process and puts DP across hosts; TP larger "
    "than a host needs a hand-built mesh over jax.devices() (passed as mesh=), and then every TP collective "
    "spans processes: collectives.plan sends it to XLA's collectives (lax, NCCL between GPUs); the FFI "
    "one-shot gathers are single-process only. Multi-process runs were tested on CPU (gloo), not on GPUs.")


# ------------------------------------------------------------------------------ the one walk
def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of the compute dtype ("bfloat16" -> 2); the model's own dtype check."""
    from jaxk3.model import resolve_dtype

    return resolve_dtype(dtype).itemsize


def _positive(name: str, value: Any) -> int:
    """`value` as an int >= 1 (Python or NumPy integer, never bool)."""
    import operator

    try:
        v = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        v = None
    if v is None or v < 1:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return int(v)


def _tp_size(tp: Any) -> int:
    return _positive("tp", tp)


def shard_shape(shape: tuple[int, ...], spec, tp: int) -> tuple[int, ...]:
    """The largest shard of a `shape` array under PartitionSpec `spec` on a mesh with `tp` ranks on
    its "tp" axis: dimensions split over "tp" ceil-divided, the rest whole."""
    out = []
    for i, n in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = entry if isinstance(entry, tuple) else (entry,)
        out.append(-(-n // tp) if TP in axes else n)
    return tuple(out)


def _param_bytes(p: params.Param, compute_bytes: int) -> int:
    return {"uint8": 1, "fp32": 4}.get(p.dtype, compute_bytes)


def _walk(cfg: KimiK3Config, tp: int, dtype: Any, shard_latent: bool, *, experts_touched: int | None = None,
          rows: int | None = None) -> dict[str, int]:
    """Bytes per rank by Param.group over the abstract tree of `cfg` at `tp`: each weight's largest
    shard; with `experts_touched`, stacked experts count only that many of E; with `rows`, the
    embedding only that many rows (as params.bytes_per_rank counts placed arrays)."""
    from jaxk3.model import abstract_weights

    tp = _tp_size(tp)
    cb = dtype_bytes(dtype)
    out = {g: 0 for g in GROUPS}
    for p in params.params(abstract_weights(cfg, tp)):
        shape = shard_shape(p.shape, p.pspec(shard_latent), tp)
        item = _param_bytes(p, cb)
        b = math.prod(shape) * item
        if experts_touched is not None and p.source == "experts":
            b = b * min(experts_touched, p.shape[0]) // p.shape[0]
        elif rows is not None and p.group == "embed":
            b = min(rows, p.shape[0]) * shape[1] * item
        out[p.group] = out.get(p.group, 0) + b
    return out


def weight_bytes_per_rank(cfg: KimiK3Config, tp: int, dtype: Any = "bfloat16",
                          shard_latent: bool = True) -> dict[str, int]:
    """HBM bytes one TP rank holds for the weights, by Param.group (all E routed experts held)."""
    return _walk(cfg, tp, dtype, shard_latent)


def step_bytes_per_rank(cfg: KimiK3Config, tp: int, batch: int, dtype: Any = "bfloat16",
                        shard_latent: bool = True) -> dict[str, int]:
    """Weight bytes one rank reads per decode step at `batch` rows, by group: min(E, batch * k)
    of the E experts, `batch` embedding rows (an upper bound: rows may pick the same experts)."""
    batch = _positive("batch", batch)
    return _walk(cfg, tp, dtype, shard_latent, experts_touched=batch * cfg.num_experts_per_token, rows=batch)


def cache_bytes(cfg: KimiK3Config, batch: int, context: int, tp: int, dtype: Any = "bfloat16") -> int:
    """Bytes of the decode cache one TP rank holds for `batch` rows (its DP shard) of `context`
    positions (KimiK3Config.cache_bytes_per_rank: the MLA latent cache is replicated over TP)."""
    from jaxk3.kernels import kda_decode

    return cfg.cache_bytes_per_rank(batch, context, _tp_size(tp), dtype_bytes(dtype), ring=kda_decode.RING)


def usable_bytes(hbm_bytes: float = H200_HBM_BYTES, reserve: float = DEFAULT_RESERVE) -> int:
    """What a layout may use per device: `hbm_bytes` less the `reserve` fraction."""
    if not hbm_bytes > 0 or not 0 <= reserve < 1:
        raise ValueError(f"hbm_bytes must be > 0 and reserve in [0, 1), got {hbm_bytes!r}, {reserve!r}")
    return int(hbm_bytes * (1 - reserve))


# ------------------------------------------------------------------------------ layouts
@dataclasses.dataclass(frozen=True)
class Layout:
    """One TP x DP layout: per-rank bytes (None where `tp` does not divide the model: see `invalid`)."""
    experts: str  # the config's experts_format
    tp: int
    dp: int
    gpus: int  # tp * dp
    hosts: int  # ceil(gpus / gpus_per_host)
    rows_per_rank: int  # ceil(batch / dp)
    weight_bytes: int | None
    cache_bytes: int | None
    total_bytes: int | None
    usable_bytes: int
    fits: bool
    tp_spans_hosts: bool  # tp > gpus_per_host: TP collectives between processes (lax / NCCL)
    shard_latent: bool = True
    invalid: str = ""  # why this tp cannot run this config (KimiK3Config.validate_tp)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DEFAULT_TPS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def default_tps() -> tuple[int, ...]:
    """TP 1, 2, 4, 8 (one host), then 16 .. 128 (whole hosts; 24, 48, 96 because K3's 96 heads
    divide by them).  A TP that does not divide the model is reported as such."""
    return DEFAULT_TPS


def _valid(cfg: KimiK3Config, tp: int, shard_latent: bool) -> str:
    try:
        cfg.validate_tp(tp, shard_latent=shard_latent)
    except ValueError as e:
        return str(e)
    return ""


def layout(cfg: KimiK3Config, tp: int, dp: int = 1, *, batch: int = DEFAULT_BATCH, context: int = DEFAULT_CONTEXT,
           dtype: Any = "bfloat16", shard_latent: bool = True, gpus_per_host: int = GPUS_PER_HOST,
           hbm_bytes: float = H200_HBM_BYTES, reserve: float = DEFAULT_RESERVE,
           _weights: int | None = None) -> Layout:
    """The layout TP `tp` x DP `dp` for `batch` rows of `context` positions (DP splits the batch)."""
    tp, dp, batch = _tp_size(tp), _positive("dp", dp), _positive("batch", batch)
    usable = usable_bytes(hbm_bytes, reserve)
    rows = -(-batch // dp)
    gpus = tp * dp
    common = dict(experts=cfg.experts_format, tp=tp, dp=dp, gpus=gpus, hosts=-(-gpus // gpus_per_host),
                  rows_per_rank=rows, usable_bytes=usable, tp_spans_hosts=tp > gpus_per_host,
                  shard_latent=shard_latent)
    why = _valid(cfg, tp, shard_latent)
    if why:
        return Layout(weight_bytes=None, cache_bytes=None, total_bytes=None, fits=False, invalid=why, **common)
    w = _weights if _weights is not None else sum(weight_bytes_per_rank(cfg, tp, dtype, shard_latent).values())
    c = cache_bytes(cfg, rows, context, tp, dtype)
    return Layout(weight_bytes=w, cache_bytes=c, total_bytes=w + c, fits=w + c <= usable, **common)


def layouts(cfg: KimiK3Config, *, batch: int = DEFAULT_BATCH, context: int = DEFAULT_CONTEXT,
            tps: Iterable[int] | None = None, dps: Iterable[int] | None = None, dtype: Any = "bfloat16",
            shard_latent: bool = True, gpus_per_host: int = GPUS_PER_HOST, hbm_bytes: float = H200_HBM_BYTES,
            reserve: float = DEFAULT_RESERVE) -> list[Layout]:
    """Every TP x DP layout of `tps` (default DEFAULT_TPS) x `dps` (default 1, 2, 4, ... up to
    `batch`): per-rank weights + cache for ceil(batch/dp) rows at `context`, and whether that fits."""
    batch = _positive("batch", batch)
    tps = tuple(tps) if tps is not None else default_tps()
    dps = tuple(dps) if dps is not None else tuple(2 ** i for i in range(int(math.log2(batch)) + 1))
    out = []
    for tp in tps:
        w = None if _valid(cfg, tp, shard_latent) else sum(weight_bytes_per_rank(cfg, tp, dtype, shard_latent).values())
        for dp in dps:
            out.append(layout(cfg, tp, dp, batch=batch, context=context, dtype=dtype, shard_latent=shard_latent,
                              gpus_per_host=gpus_per_host, hbm_bytes=hbm_bytes, reserve=reserve, _weights=w))
    return out


def min_gpus(cfg: KimiK3Config, *, batch: int = DEFAULT_BATCH, context: int = DEFAULT_CONTEXT,
             tps: Iterable[int] | None = None, dtype: Any = "bfloat16", shard_latent: bool = True,
             gpus_per_host: int = GPUS_PER_HOST, hbm_bytes: float = H200_HBM_BYTES,
             reserve: float = DEFAULT_RESERVE) -> dict[int, Layout]:
    """Per TP: the layout with the fewest GPUs that fits (the smallest DP <= batch splitting the
    batch's cache enough), or the DP-1 layout with fits=False where even one row does not fit
    (weights too big at that TP) or TP does not divide the model.  Where shard_latent=True does
    not divide (K3's routed_expert_hidden_size 3584 at TP 24, 48, 96) the replicated latent
    (shard_latent=False, stock vLLM) is tried: the layout says which."""
    usable = usable_bytes(hbm_bytes, reserve)
    out = {}
    for tp in (tuple(tps) if tps is not None else default_tps()):
        kw = dict(batch=batch, context=context, dtype=dtype, shard_latent=shard_latent, gpus_per_host=gpus_per_host,
                  hbm_bytes=hbm_bytes, reserve=reserve)
        first = layout(cfg, tp, 1, **kw)
        if first.invalid and shard_latent and not _valid(cfg, tp, False):
            kw["shard_latent"] = False
            first = layout(cfg, tp, 1, **kw)
        out[tp] = first
        if first.fits or first.invalid:
            continue
        one_row = first.weight_bytes + cache_bytes(cfg, 1, context, tp, dtype)
        if one_row > usable:
            continue
        # the cache of r rows is affine in r: binary search the fewest rows per rank that fit, then dp
        lo, hi = 1, batch  # rows that fit: lo; rows that do not: hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if first.weight_bytes + cache_bytes(cfg, mid, context, tp, dtype) <= usable:
                lo = mid
            else:
                hi = mid
        out[tp] = layout(cfg, tp, -(-batch // lo), _weights=first.weight_bytes, **kw)
    return out


def _formats(cfg: KimiK3Config) -> dict[str, KimiK3Config | str]:
    """`cfg` with each experts format ("mxfp4", "dense"), or why the format cannot hold it."""
    out: dict[str, KimiK3Config | str] = {}
    for fmt in ("mxfp4", "dense"):
        if "moe" not in cfg.layer_ffn and fmt == "mxfp4":
            out[fmt] = "no MoE layers"
            continue
        try:
            out[fmt] = dataclasses.replace(cfg, experts_format=fmt)
        except ValueError as e:
            out[fmt] = str(e)
    return out


def fewest(table: dict[int, Layout]) -> Layout | None:
    """The fitting layout with the fewest GPUs (then the smallest TP) of a `min_gpus` table."""
    fits = [l for l in table.values() if l.fits]
    return min(fits, key=lambda l: (l.gpus, l.tp)) if fits else None


# ------------------------------------------------------------------------------ report
def info(cfg: KimiK3Config, tp: int, *, batch: int = DEFAULT_BATCH, context: int = DEFAULT_CONTEXT,
         dtype: Any = "bfloat16", shard_latent: bool = True, gpus_per_host: int = GPUS_PER_HOST,
         hbm_bytes: float = H200_HBM_BYTES, reserve: float = DEFAULT_RESERVE, tps: Iterable[int] | None = None,
         checkpoint: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON-able memory report of `cfg` at TP `tp` (see `report` for the text)."""
    from jaxk3.model import resolve_dtype

    batch, context, tp = _positive("batch", batch), _positive("context", context), _tp_size(tp)
    dtype_name = str(resolve_dtype(dtype))
    invalid = _valid(cfg, tp, shard_latent)
    weights = None if invalid else weight_bytes_per_rank(cfg, tp, dtype, shard_latent)
    step = None if invalid else step_bytes_per_rank(cfg, tp, batch, dtype, shard_latent)
    cache = None if invalid else cache_bytes(cfg, batch, context, tp, dtype)
    usable = usable_bytes(hbm_bytes, reserve)
    kw = dict(batch=batch, context=context, dtype=dtype, shard_latent=shard_latent, gpus_per_host=gpus_per_host,
              hbm_bytes=hbm_bytes, reserve=reserve, tps=tuple(tps) if tps is not None else default_tps())
    h200 = {}
    for fmt, c in _formats(cfg).items():
        if isinstance(c, str):
            h200[fmt] = {"unavailable": c}
            continue
        table = min_gpus(c, **kw)
        best = fewest(table)
        h200[fmt] = {"by_tp": [l.to_dict() for l in table.values()], "fewest": None if best is None else best.to_dict()}
    w_total = None if weights is None else sum(weights.values())
    return {
        "experts": cfg.experts_format, "tp": tp, "dtype": dtype_name, "shard_latent": shard_latent,
        "batch": batch, "context": context, "invalid": invalid,
        "weight_bytes_per_rank": weights, "weight_bytes_per_rank_total": w_total,
        "step_bytes_per_rank": step, "step_bytes_per_rank_total": None if step is None else sum(step.values()),
        "cache_bytes_per_rank": cache, "total_bytes_per_rank": None if w_total is None else w_total + cache,
        "hbm_bytes": int(hbm_bytes), "reserve": reserve, "usable_bytes": usable, "gpus_per_host": gpus_per_host,
        "fits": w_total is not None and w_total + cache <= usable,
        "h200": h200, "cross_host": CROSS_HOST_NOTE, "checkpoint": checkpoint,
    }


def _gb(b: int | None) -> str:
    return "-" if b is None else f"{b / GB:,.2f}"


def format_report(d: dict[str, Any]) -> str:
    """The text of an `info` dict."""
    lines = []
    if d.get("checkpoint"):
        ck = d["checkpoint"]
        lines.append(f"checkpoint {ck['path']}: {ck['tensors']} tensors, {_gb(ck['bytes'])} GB on disk; "
                     f"routed experts {ck['experts_on_disk']} (read: config.json and safetensors headers only)")
    lines.append(f"memory per rank: TP {d['tp']}, {d['dtype']}, experts {d['experts']}, "
                 f"shard_latent={d['shard_latent']}, batch {d['batch']} x context {d['context']} "
                 "(from the declared shapes and PartitionSpecs; nothing allocated)")
    if d["invalid"]:
        lines.append(f"  TP {d['tp']} cannot run this model: {d['invalid']}")
    else:
        lines.append(f"  {'part':<24}{'HBM GB/rank':>14}{'read/step GB':>14}")
        for g in GROUPS:
            w, s = d["weight_bytes_per_rank"][g], d["step_bytes_per_rank"][g]
            if w:
                lines.append(f"  {g:<24}{_gb(w):>14}{_gb(s):>14}")
        lines.append(f"  {'weights':<24}{_gb(d['weight_bytes_per_rank_total']):>14}"
                     f"{_gb(d['step_bytes_per_rank_total']):>14}")
        rows = f"{d['batch']} row{'s' if d['batch'] > 1 else ''}"
        lines.append(f"  {'cache':<24}{_gb(d['cache_bytes_per_rank']):>14}"
                     f"   ({rows} x {d['context']} positions; the MLA latent cache is replicated over TP)")
        lines.append(f"  {'total':<24}{_gb(d['total_bytes_per_rank']):>14}"
                     f"   {'fits' if d['fits'] else 'does NOT fit'} in {_gb(d['usable_bytes'])} GB")
    lines.append(f"usable per H200: {_gb(d['usable_bytes'])} GB = {_gb(d['hbm_bytes'])} GB HBM less "
                 f"{d['reserve']:.0%} for activations and XLA workspace (JAX preallocates 75% unless "
                 "XLA_PYTHON_CLIENT_MEM_FRACTION is raised)")
    lines.append(f"H200s needed (batch {d['batch']} x context {d['context']}, DP splits the batch, "
                 f"{d['gpus_per_host']} GPUs per host):")
    for fmt, h in d["h200"].items():
        if "unavailable" in h:
            lines.append(f"  experts {fmt}: not possible ({h['unavailable']})")
            continue
        lines.append(f"  experts {fmt}:")
        lines.append(f"    {'TP':>4}{'weights GB/rank':>17}{'total GB/rank':>15}{'H200s':>7}{'DP':>5}{'hosts':>7}")
        for l in h["by_tp"]:
            if l["invalid"]:
                lines.append(f"    {l['tp']:>4}  -  TP does not divide: {l['invalid']}")
                continue
            n = (f"{l['gpus']:>7}{l['dp']:>5}{l['hosts']:>7}" if l["fits"] else f"{'no fit':>7}{'':>5}{'':>7}")
            span = "  (TP across hosts)" if l["tp_spans_hosts"] and l["fits"] else ""
            if not l["shard_latent"]:
                span += "  (shard_latent=False)"
            lines.append(f"    {l['tp']:>4}{_gb(l['weight_bytes']):>17}{_gb(l['total_bytes']):>15}{n}{span}")
        b = h["fewest"]
        lines.append("    fewest: " + ("none of these layouts fits" if b is None else
                                       f"{b['gpus']} H200{'s' if b['gpus'] > 1 else ''} (TP {b['tp']} x DP "
                                       f"{b['dp']}, {b['hosts']} host{'s' if b['hosts'] > 1 else ''})"))
    lines.append("across hosts: " + d["cross_host"])
    return "\n".join(lines)


def report(cfg: KimiK3Config, tp: int, **kw: Any) -> str:
    """The text `jaxk3 info --tp N` prints: bytes per rank by part (HBM held and read per step),
    the cache, and the fewest H200s per TP for MXFP4 and dense experts.  `kw` as for `info`."""
    return format_report(info(cfg, tp, **kw))


# ------------------------------------------------------------------------------ checkpoints
def checkpoint_config(path: str | os.PathLike, experts: str = "auto") -> tuple[KimiK3Config, dict[str, Any]]:
    """(config with its experts format, a summary) of a checkpoint directory, from config.json and
    the safetensors headers only (never tensor data).  experts: "auto" (MXFP4 where the checkpoint's
    experts are), "mxfp4" or "dense" (as load_model).  The headers are checked against the model's
    tensors (names, shapes, dtypes: checkpoint.build_plan, which reads no data either), so a
    checkpoint that load_model would refuse raises the same CheckpointError here."""
    from jaxk3 import checkpoint as ck

    path = os.fspath(path)
    cfg = ck.load_config(path)
    tensors = ck.scan_checkpoint(path)
    source = ck.SafetensorsSource(tensors)
    on_disk = ck.resolve_experts(cfg, source, "auto").experts_format if "moe" in cfg.layer_ffn else "none"
    cfg = ck.resolve_experts(cfg, source, experts)
    ck.build_plan(cfg, source, 1)  # the TP size only pads the vocab tables; the checks are the same
    summary = {"path": path, "tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors.values()),
               "experts_on_disk": on_disk, "experts": cfg.experts_format}
    return cfg, summary


def checkpoint_report(path: str | os.PathLike, tp: int, experts: str = "auto", **kw: Any) -> dict[str, Any]:
    """`info` of a checkpoint directory (config.json + headers only); `kw` as for `info`."""
    cfg, summary = checkpoint_config(path, experts)
    return info(cfg, tp, checkpoint=summary, **kw)


def _declares_mxfp4(raw: Any) -> bool:
    """Whether a config.json's quantization_config (top level or in text_config) says MXFP4."""
    from jaxk3.checkpoint import MXFP4_FORMAT

    if not isinstance(raw, dict):
        return False
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    q = text.get("quantization_config", raw.get("quantization_config"))
    return isinstance(q, dict) and MXFP4_FORMAT in json.dumps(q)


def config_for(name: str, experts: str = "auto") -> KimiK3Config:
    """A config without a checkpoint: "k3", "kimi-linear-48b", "tiny" or a config.json / directory.
    experts "auto": MXFP4 for "k3" (K3 ships MXFP4 experts) and for a config.json whose
    quantization_config says mxfp4-pack-quantized, else dense."""
    from jaxk3.tools.bench_decode import load_config
    from jaxk3.checkpoint import EXPERTS

    if experts not in EXPERTS:
        raise ValueError(f"experts: must be one of {EXPERTS}, got {experts!r}")
    cfg = load_config(name)
    fmt = experts
    if experts == "auto":
        fmt = "dense"
        if "moe" in cfg.layer_ffn:
            if name == "k3":
                fmt = "mxfp4"
            elif name not in ("kimi-linear-48b", "tiny"):
                path = os.path.join(name, "config.json") if os.path.isdir(name) else name
                with open(path) as f:
                    fmt = "mxfp4" if _declares_mxfp4(json.load(f)) else "dense"
    try:
        return dataclasses.replace(cfg, experts_format=fmt)
    except ValueError as e:
        raise ValueError(f"experts={experts!r}: {e}") from None


def cli_info(*, checkpoint: str | None = None, config: str | None = None, tp: int = 8, experts: str = "auto",
             batch: int = DEFAULT_BATCH, context: int = DEFAULT_CONTEXT, **kw: Any) -> dict[str, Any]:
    """What `jaxk3 info --checkpoint DIR | --config NAME --tp N` reports (`format_report` prints it).
    Raises ValueError (CheckpointError included) or OSError naming the problem."""
    if (checkpoint is None) == (config is None):
        raise ValueError("give one of --checkpoint DIR or --config k3|kimi-linear-48b|tiny|PATH")
    if checkpoint is not None:
        return checkpoint_report(checkpoint, tp, experts, batch=batch, context=context, **kw)
    return info(config_for(config, experts), tp, batch=batch, context=context, **kw)


# ------------------------------------------------------------------------------ this machine
def device_memory(device) -> tuple[int | None, str]:
    """(bytes, what) a rank on `device` can use: the accelerator's `memory_stats()["bytes_limit"]`,
    else (CPU) the host's physical memory, which every CPU device of the process shares; (None, ...)
    if unknown."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without memory statistics
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.platform} device memory"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
    except (ValueError, OSError, AttributeError):
        return None, "unknown memory"


def human_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def fit_problem(per_rank: int, what: str, devices: list, detail: str = "") -> str | None:
    """Whether `per_rank` bytes fit each of `devices` (this process's ranks): the problem, or None.
    Fake CPU devices share the host's memory, so there every rank counts against it."""
    limit, where = device_memory(devices[0])
    if limit is None:
        return None
    ranks = len(devices) if devices[0].platform == "cpu" else 1
    need = per_rank * ranks
    if need <= limit:
        return None
    times = f" x {ranks} CPU ranks = {human_bytes(need)}" if ranks > 1 else ""
    return (f"{what} needs {human_bytes(per_rank)} per rank{f' ({detail})' if detail else ''}{times}, more than "
            f"the {human_bytes(limit)} of {where}")


__all__ = ["device_memory", "human_bytes", "fit_problem", "GROUPS", "H200_HBM_BYTES", "DEFAULT_RESERVE", "Layout", "weight_bytes_per_rank", "step_bytes_per_rank",
           "cache_bytes", "usable_bytes", "layout", "layouts", "min_gpus", "fewest", "info", "format_report",
           "report", "checkpoint_config", "checkpoint_report", "config_for", "cli_info"]
