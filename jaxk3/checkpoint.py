"""Load Kimi-K3 / Kimi-Linear safetensors checkpoints straight into a sharded `Model`.

    model = jaxk3.load_model("/path/to/ckpt", tp=8, dtype="bfloat16")

A checkpoint directory holds `config.json` and one `*.safetensors` file, or several with
`model.safetensors.index.json` (`weight_map`: tensor name -> file).  Both namings are read:

* Kimi-K3 (multimodal): `config.json` nests the text model under `text_config`; text tensors carry
  the `language_model.` prefix (`language_model.model.layers.…` or `language_model.layers.…`);
  vision tensors (`vision_tower.*`, `mm_projector.*`, …) are never opened.  Routed experts are
  compressed-tensors `mxfp4-pack-quantized` (`weight_packed` + `weight_scale`, see `jaxk3.mxfp4`)
  and are dequantised to the compute dtype here.
* Kimi-Linear: flat config, `model.layers.…`, bf16 experts, `A_log` [1, 1, H, 1].

Memory: every weight is built device by device from its `NamedSharding` in `jaxk3.sharding`
(`addressable_devices_indices_map` -> one read per device -> `jax.device_put` to that device ->
`make_array_from_single_device_arrays`).  A device's read takes only its slice of each source
tensor (`safe_open(file).get_slice(name)[rows, cols]`), and the slice is on the device before the
next is read.  Host memory therefore peaks near the largest single rank slice (a stacked expert
weight's rank slice, or a replicated tensor, read once and put on every device), not the model.
(`jax.make_array_from_callback` would hold every device's slice of a weight at once.)

Errors (all `CheckpointError`, a `ValueError`) are raised after reading only the JSON files and the
safetensors headers, before any tensor data is read or anything compiled; nothing half-loaded is
returned: missing tensor (named), wrong shape (name, expected, found), unknown / unsupported dtype,
truncated or corrupt file, unsupported config field.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import struct
from typing import Any, Callable, Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, which safetensors' numpy reader needs)
import numpy as np

try:
    from safetensors import safe_open
except ImportError:  # optional dependency: pip install "jaxk3[checkpoint]"
    safe_open = None

from jaxk3 import mxfp4
from jaxk3 import sharding as shd
from jaxk3.config import KimiK3Config

INDEX_FILE = "model.safetensors.index.json"
MXFP4_FORMAT = "mxfp4-pack-quantized"

#: safetensors dtype tags -> bytes per element (the format's full list, safetensors 0.8)
ST_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                  "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
#: dtypes a dense (unquantised) weight may have
DENSE_DTYPES = ("BF16", "F16", "F32", "F64")


class CheckpointError(ValueError):
    """Any problem with a checkpoint directory, raised before tensor data is read."""


class MissingTensorError(CheckpointError):
    pass


class TensorShapeError(CheckpointError):
    pass


class TensorDtypeError(CheckpointError):
    pass


class CorruptCheckpointError(CheckpointError):
    pass


class UnsupportedConfigError(CheckpointError):
    pass


# ------------------------------------------------------------------------ headers and index
@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str  # name in the checkpoint (with any `language_model.` prefix)
    file: str  # absolute path
    dtype: str  # safetensors tag
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ST_DTYPE_BYTES[self.dtype]


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header (8-byte little-endian length + JSON) without reading data."""
    fname = os.path.basename(path)
    size = os.path.getsize(path)
    if size < 8:
        raise CorruptCheckpointError(f"{fname}: {size} bytes, too short for a safetensors file (truncated?)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise CorruptCheckpointError(
                f"{fname}: header length field says {n} bytes but the file has only {size - 8} after it "
                "(truncated or not a safetensors file)")
        raw = f.read(n)
    try:
        hdr = json.loads(raw.decode("utf-8"))
        if not isinstance(hdr, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{fname}: header is not valid safetensors JSON ({e})") from None
    data_bytes = size - 8 - n
    out = {}
    for name, ent in hdr.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = ent["dtype"], tuple(int(s) for s in ent["shape"]), ent["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(f"{fname}: header entry {name!r} is malformed: {ent!r}") from None
        if dtype not in ST_DTYPE_BYTES:
            raise TensorDtypeError(f"{fname}: tensor {name!r} has unknown dtype {dtype!r} "
                                   f"(safetensors dtypes: {', '.join(ST_DTYPE_BYTES)})")
        if any(s < 0 for s in shape):
            raise CorruptCheckpointError(f"{fname}: tensor {name!r} has a negative dimension {shape}")
        want = math.prod(shape) * ST_DTYPE_BYTES[dtype]
        if not (0 <= b <= e) or e - b != want:
            raise CorruptCheckpointError(
                f"{fname}: tensor {name!r} data_offsets {[b, e]} do not hold {dtype}{list(shape)} ({want} bytes)")
        if e > data_bytes:
            raise CorruptCheckpointError(
                f"{fname}: tensor {name!r} ends at data byte {e} but the file holds only {data_bytes} "
                "(truncated file)")
        out[name] = TensorInfo(name, os.path.abspath(path), dtype, shape)
    return out


def scan_checkpoint(path: str) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint directory (checkpoint names), from the index and/or the headers."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint: {path!r} is not a directory")
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                wmap = json.load(f)["weight_map"]
            if not isinstance(wmap, dict):
                raise ValueError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{INDEX_FILE}: not a valid index ({e!r})") from None
        files = sorted(set(wmap.values()))
        for fn in files:
            if not os.path.exists(os.path.join(path, fn)):
                raise CorruptCheckpointError(f"{INDEX_FILE}: lists shard {fn!r}, which is not in {path}")
        headers = {fn: read_header(os.path.join(path, fn)) for fn in files}
        out = {}
        for name, fn in wmap.items():
            if name not in headers[fn]:
                raise CorruptCheckpointError(f"{INDEX_FILE}: says {name!r} is in {fn}, but its header lacks it")
            out[name] = headers[fn][name]
        return out
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"checkpoint: no *.safetensors files in {path}")
    out = {}
    for fp in files:
        for name, info in read_header(fp).items():
            if name in out:
                raise CorruptCheckpointError(
                    f"checkpoint: tensor {name!r} is in both {os.path.basename(out[name].file)} and "
                    f"{os.path.basename(fp)} (and there is no {INDEX_FILE})")
            out[name] = info
    return out


def _internal_names(tensors: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """Model-side names: K3's `language_model.` prefix dropped (and `layers.` -> `model.layers.`)."""
    out, prefixed = {}, {}
    for k, v in tensors.items():
        if k.startswith("language_model."):
            k2 = k[len("language_model."):]
            prefixed["model." + k2 if k2.startswith("layers.") else k2] = v
        else:
            out[k] = v
    out.update(prefixed)  # the text model's own tensors win over any same-named unprefixed ones
    return out


# ----------------------------------------------------------------------------- config
def _config_error(msg: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"config.json: {msg}")


def _check_quantization(q: Any) -> bool:
    """Accept only compressed-tensors MXFP4 (group 32, symmetric, float 4-bit). Returns True if quantised."""
    if q is None:
        return False
    if not isinstance(q, Mapping):
        raise _config_error(f"quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise _config_error(f"quantization_config.quant_method = {method!r} is not supported "
                            f"(only 'compressed-tensors' with format {MXFP4_FORMAT!r})")
    groups = q.get("config_groups") or {}
    top_fmt = q.get("format")
    if top_fmt not in (None, MXFP4_FORMAT, "mixed-precision"):
        raise _config_error(f"quantization_config.format = {top_fmt!r} is not supported (only {MXFP4_FORMAT!r})")
    for g, grp in groups.items():
        fmt = grp.get("format", top_fmt)
        if fmt not in (None, MXFP4_FORMAT):
            raise _config_error(f"quantization_config.config_groups.{g}.format = {fmt!r} is not supported "
                                f"(only {MXFP4_FORMAT!r})")
        w = grp.get("weights") or {}
        for fld, ok in (("num_bits", 4), ("type", "float"), ("group_size", 32), ("symmetric", True)):
            if fld in w and w[fld] != ok:
                raise _config_error(f"quantization_config.config_groups.{g}.weights.{fld} = {w[fld]!r} is not "
                                    f"supported ({MXFP4_FORMAT} needs {ok!r})")
        if w.get("strategy") not in (None, "group"):
            raise _config_error(f"quantization_config.config_groups.{g}.weights.strategy = {w['strategy']!r} "
                                "is not supported (needs 'group')")
        if grp.get("input_activations"):
            raise _config_error(f"quantization_config.config_groups.{g}.input_activations is set: activation "
                                "quantisation is not supported (weights are dequantised at load time)")
    return True


def load_config(path: str) -> KimiK3Config:
    """`KimiK3Config` from `path/config.json`, with every unsupported field reported as UnsupportedConfigError."""
    cpath = os.path.join(path, "config.json")
    if not os.path.exists(cpath):
        raise CheckpointError(f"checkpoint: no config.json in {path}")
    try:
        with open(cpath) as f:
            raw = json.load(f)
    except ValueError as e:
        raise CorruptCheckpointError(f"config.json: not valid JSON ({e})") from None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else raw
    mt = text.get("model_type")
    if mt not in (None, "kimi_linear", "kimi_k3"):
        raise _config_error(f"model_type = {mt!r} is not supported (the text model must be 'kimi_linear')")
    _check_quantization(text.get("quantization_config", raw.get("quantization_config")))
    # num_nextn_predict_layers (MTP) only adds tensors the decode step never reads: ignored.
    try:
        return KimiK3Config.from_pretrained(raw)
    except ValueError as e:
        raise _config_error(str(e)) from None


# ------------------------------------------------------------------------- the load plan
def _norm_index(idx: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    out = []
    for s, n in zip(tuple(idx) + (slice(None),) * (len(shape) - len(idx)), shape):
        a, b, st = s.indices(n)
        assert st == 1, idx
        out.append((a, b))
    return tuple(out)


class _Reader:
    """Open safetensors handles (one per file) and every slice read; `reads` logs (name, bytes)."""

    def __init__(self):
        self._handles: dict[str, Any] = {}

    def get(self, info: TensorInfo, idx: tuple) -> np.ndarray:
        h = self._handles.get(info.file)
        if h is None:
            try:
                h = self._handles[info.file] = safe_open(info.file, framework="numpy")
            except Exception as e:  # safetensors raises its own SafetensorError
                raise CorruptCheckpointError(f"{os.path.basename(info.file)}: cannot open ({e})") from None
        return np.asarray(h.get_slice(info.name)[idx])

    def close(self) -> None:
        self._handles.clear()


class _Leaf:
    """One placed weight: its global (padded / stacked) shape and how to read any block of it."""

    def __init__(self, shape: tuple[int, ...], read: Callable[["_Reader", tuple[tuple[int, int], ...]], np.ndarray]):
        self.shape, self._read = tuple(shape), read

    def read(self, reader: _Reader, blk: tuple[tuple[int, int], ...]) -> np.ndarray:
        return self._read(reader, blk)


def _sl(blk) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in blk)


def _dense_leaf(info: TensorInfo, shape: tuple[int, ...], pad_rows: bool = False) -> _Leaf:
    def read(r: _Reader, blk):
        if not pad_rows:
            return r.get(info, _sl(blk))
        (a, b), rest = blk[0], blk[1:]
        n = info.shape[0]
        cols = tuple(e - s for s, e in rest)
        got = r.get(info, _sl(((a, min(b, n)),) + rest)) if a < n else np.zeros((0,) + cols, np.float32)
        if b <= n:
            return got
        return np.concatenate([got, np.zeros((b - max(a, n),) + cols, got.dtype)])
    return _Leaf(shape, read)


def _a_log_leaf(info: TensorInfo, H: int) -> _Leaf:
    def read(r: _Reader, blk):
        (a, b), = blk
        if len(info.shape) == 1:
            return r.get(info, (slice(a, b),))
        return r.get(info, (slice(0, 1), slice(0, 1), slice(a, b), slice(0, 1))).reshape(-1)
    return _Leaf((H,), read)


def _mxfp4_part(packed: TensorInfo, scale: TensorInfo) -> Callable[[_Reader, tuple], np.ndarray]:
    def read(r: _Reader, blk):
        (r0, r1), (c0, c1) = blk
        p0, p1 = c0 // 2, -(-c1 // 2)
        g0, g1 = c0 // mxfp4.GROUP, -(-c1 // mxfp4.GROUP)
        w = mxfp4.dequantize(r.get(packed, (slice(r0, r1), slice(p0, p1))),
                             r.get(scale, (slice(r0, r1), slice(g0, g1))),
                             np.float32, col_offset=2 * p0 - mxfp4.GROUP * g0)
        return w[:, c0 - 2 * p0: c1 - 2 * p0]
    return read


def _stacked_leaf(parts: list[Callable], shape: tuple[int, ...]) -> _Leaf:
    def read(r: _Reader, blk):
        (e0, e1), rest = blk[0], blk[1:]
        return np.stack([parts[e](r, rest) for e in range(e0, e1)])
    return _Leaf(shape, read)


def _dense_part(info: TensorInfo) -> Callable[[_Reader, tuple], np.ndarray]:
    return lambda r, blk: r.get(info, _sl(blk))


def build_plan(cfg: KimiK3Config, tensors: Mapping[str, TensorInfo], tp: int):
    """A `Weights` pytree of `_Leaf`s; checks every name, shape and dtype first (raises CheckpointError)."""
    from jaxk3.model import assemble_weights, hf_tensor_shapes

    names = _internal_names(tensors)
    want = hf_tensor_shapes(cfg)
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" not in names
    if cfg.tie_word_embeddings and not tied_head:
        want["lm_head.weight"] = want["model.embed_tokens.weight"]

    def info(name: str) -> TensorInfo:
        if name not in names:
            if name.endswith(".weight") and name[: -len("weight")] + "weight_packed" in names:
                raise UnsupportedConfigError(
                    f"checkpoint: {_ckpt_name(name)[: -len('.weight')]!r} is quantised (weight_packed); only the "
                    "routed experts may be MXFP4 in this port")
            raise MissingTensorError(f"checkpoint: missing tensor {_ckpt_name(name)!r}")
        return names[name]

    def _ckpt_name(name: str) -> str:
        return name if not any(k.startswith("language_model.") for k in tensors) else (
            "language_model." + name)

    def check(name: str, t: TensorInfo, shape: tuple[int, ...], dtypes=DENSE_DTYPES) -> TensorInfo:
        if t.dtype not in dtypes:
            raise TensorDtypeError(f"checkpoint: tensor {t.name!r} has dtype {t.dtype}; this weight must be one "
                                   f"of {', '.join(dtypes)}")
        if tuple(t.shape) != tuple(shape):
            raise TensorShapeError(f"checkpoint: tensor {t.name!r} has shape {list(t.shape)}, expected "
                                   f"{list(shape)}")
        return t

    def dense(name: str) -> _Leaf:
        shape = want[name][0]
        return _dense_leaf(check(name, info(name), shape), shape)

    def a_log(name: str) -> _Leaf:
        H = cfg.kda_num_heads
        t = info(name)
        check(name, t, t.shape)  # dtype only
        # K3 headers list [128] (vLLM uses the first num_heads entries, spec §2); Kimi-Linear [1, 1, H, 1]
        ok = (len(t.shape) == 1 and t.shape[0] >= H) or tuple(t.shape) == (1, 1, H, 1)
        if not ok:
            raise TensorShapeError(f"checkpoint: tensor {t.name!r} has shape {list(t.shape)}, expected [{H}] "
                                   f"(or [N >= {H}], of which the first {H} are used, or [1, 1, {H}, 1])")
        return _a_log_leaf(t, H)

    def vocab(name: str) -> _Leaf:
        V, D = want[name][0]
        t = check(name, info(name), (V, D))
        return _dense_leaf(t, (cfg.padded_vocab(tp), D), pad_rows=True)

    def expert(name: str, shape: tuple[int, int]) -> Callable:
        base = name[: -len(".weight")]
        if name in names:
            return _dense_part(check(name, names[name], shape))
        if base + ".weight_packed" not in names:
            raise MissingTensorError(f"checkpoint: missing tensor {_ckpt_name(name)!r} "
                                     f"(nor MXFP4 {_ckpt_name(base + '.weight_packed')!r})")
        rows, cols = shape
        if cols % mxfp4.GROUP:
            raise UnsupportedConfigError(f"checkpoint: {base} has {cols} input columns, not a multiple of the "
                                         f"MXFP4 group {mxfp4.GROUP}")
        p = check(base + ".weight_packed", names[base + ".weight_packed"], (rows, cols // 2), ("U8",))
        s = check(base + ".weight_scale", info(base + ".weight_scale"), (rows, cols // mxfp4.GROUP), ("U8",))
        return _mxfp4_part(p, s)

    def leaf(name: str) -> _Leaf:
        if name.endswith(".A_log"):
            return a_log(name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return vocab(name)
        return dense(name)

    E, I, L = cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_hidden

    def experts(m: str, i: int) -> _Leaf:
        shape = (L, I) if i == 2 else (I, L)
        return _stacked_leaf([expert(f"{m}experts.{e}.w{i}.weight", shape) for e in range(E)], (E,) + shape)

    return assemble_weights(cfg, leaf, experts, tied_head=tied_head)


# ------------------------------------------------------------------------------ placing
def _leaves(plan) -> list:
    out = []
    shd.map_weights(lambda k, leaf: out.append((k, leaf)), plan)
    return out


def place_plan(plan, mesh, dtype, shard_latent: bool, progress: Callable[[int, int], None] | None = None):
    """Every `_Leaf` -> a jax.Array sharded by the table, each device's block read from disk on its own."""
    import jax
    from jax.sharding import NamedSharding

    def target(key: str):
        return np.dtype(np.float32) if key in shd.FP32_WEIGHTS else np.dtype(dtype)

    total = sum(math.prod(leaf.shape) * target(k).itemsize for k, leaf in _leaves(plan))
    done = 0
    reader = _Reader()

    def put(key: str, leaf: _Leaf):
        nonlocal done
        dt = target(key)
        sharding = NamedSharding(mesh, shd.spec(key, shard_latent))
        last: list = [None, None]  # (block, host array): replicated blocks are read once for all devices
        shards = []
        for dev, idx in sharding.addressable_devices_indices_map(leaf.shape).items():
            blk = _norm_index(idx, leaf.shape)
            if last[0] != blk:
                last[:] = [None, None]  # drop the previous rank's slice before reading the next
                last[:] = [blk, np.ascontiguousarray(leaf.read(reader, blk).astype(dt, copy=False))]
            # one rank's slice to its device; wait, so at most one slice is held on the host
            shards.append(jax.device_put(last[1], dev).block_until_ready())
        last[:] = [None, None]
        arr = jax.make_array_from_single_device_arrays(leaf.shape, sharding, shards)
        done += math.prod(leaf.shape) * dt.itemsize
        if progress is not None:
            progress(done, total)
        return arr

    try:
        return shd.map_weights(put, plan)
    finally:
        reader.close()


def load_model(path: str | os.PathLike, mesh=None, tp: int | None = None, dtype: Any = "bfloat16",
               gather: str = "auto", shard_latent: bool = True,
               progress: Callable[[int, int], None] | None = None):
    """A sharded `Model` from a K3 / Kimi-Linear safetensors directory (see the module docstring).

    `progress(done_bytes, total_bytes)` is called after each weight is placed.  Raises
    `CheckpointError` (subclasses named after the problem) before reading any tensor data.
    """
    from jaxk3.model import GATHER_IMPLS, Model, _resolve_dtype, make_mesh

    path = os.fspath(path)
    if safe_open is None:
        raise CheckpointError("checkpoint: loading needs the `safetensors` package (pip install safetensors)")
    if gather not in GATHER_IMPLS:
        raise ValueError(f"gather: must be one of {GATHER_IMPLS}, got {gather!r}")
    dt = _resolve_dtype(dtype)
    cfg = load_config(path)
    mesh = make_mesh(mesh, tp)
    tp_size = mesh.shape[shd.TP]
    cfg.validate_tp(tp_size, shard_latent=shard_latent)
    tensors = scan_checkpoint(path)
    plan = build_plan(cfg, tensors, tp_size)
    weights = place_plan(plan, mesh, dt, shard_latent, progress)
    return Model(cfg, weights, mesh, dt, gather, shard_latent)


# ------------------------------------------------------------------------------ writing
def save_checkpoint(path: str | os.PathLike, cfg: KimiK3Config, flat: Mapping[str, np.ndarray], *,
                    k3_layout: bool = False, mxfp4_experts: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
                    num_shards: int = 1, extra: Mapping[str, np.ndarray] | None = None,
                    dtype: Any = None) -> None:
    """Write `flat` (HF names, no prefix) as a checkpoint directory in the real layout (tests, tools).

    k3_layout: nested `text_config`, `language_model.` prefix, compressed-tensors quantization_config.
    mxfp4_experts: {`…experts.{e}.w{i}` : (weight_packed, weight_scale)} written instead of `.weight`.
    num_shards > 1 splits tensors round-robin over files and writes `model.safetensors.index.json`.
    extra: more tensors written as is (e.g. vision weights).  dtype: cast float tensors (e.g. bfloat16).
    """
    from safetensors.numpy import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    hf = cfg.to_hf_dict()
    pre = "language_model." if k3_layout else ""
    out: dict[str, np.ndarray] = {}
    for k, v in flat.items():
        v = np.asarray(v)
        if dtype is not None and v.dtype.kind == "f" and not k.endswith(("A_log", "dt_bias", "conv1d.weight",
                                                                          "o_norm.weight", "correction_bias")):
            v = v.astype(dtype)
        out[pre + k] = v
    for base, (packed, scale) in (mxfp4_experts or {}).items():
        out.pop(pre + base + ".weight", None)
        out[pre + base + ".weight_packed"] = np.asarray(packed, np.uint8)
        out[pre + base + ".weight_scale"] = np.asarray(scale, np.uint8)
    out.update(extra or {})
    if k3_layout:
        cfgd = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                "text_config": hf, "vision_config": {"hidden_size": 32}}
        if mxfp4_experts:
            cfgd["quantization_config"] = {
                "quant_method": "compressed-tensors", "format": MXFP4_FORMAT,
                "config_groups": {"group_0": {"format": MXFP4_FORMAT, "targets": ["Linear"],
                                              "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                          "strategy": "group", "symmetric": True}}},
                "ignore": ["re:.*shared_experts.*", "re:vision_tower.*"]}
    else:
        cfgd = dict(hf, architectures=["KimiLinearForCausalLM"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfgd, f, indent=1)
    names = sorted(out)
    if num_shards <= 1:
        save_file({k: np.ascontiguousarray(out[k]) for k in names}, os.path.join(path, "model.safetensors"))
        return
    wmap = {}
    for s in range(num_shards):
        fn = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {k: np.ascontiguousarray(out[k]) for k in names[s::num_shards]}
        save_file(part, os.path.join(path, fn))
        wmap.update({k: fn for k in part})
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": int(sum(v.nbytes for v in out.values()))}, "weight_map": wmap}, f,
                  indent=1)
