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

Memory: every weight is built device by device from the `NamedSharding` its block declares
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

import jax

from jaxk3 import mxfp4, params
from jaxk3.kernels.moe_experts import f16_exact, with_f16
from jaxk3.model import Weights, abstract_weights
from jaxk3.config import KimiK3Config, json_type
from jaxk3.params import Param
from jaxk3.sharding import TP

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


class NonFiniteTensorError(CheckpointError):
    """A tensor holds NaN or Inf (raised while it is read, before the model is built)."""


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
    if os.path.isdir(path):
        raise CorruptCheckpointError(f"{path}: is a directory, not a safetensors file")
    try:
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
    except OSError as e:  # no permission, a dangling link, an I/O error
        raise CorruptCheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
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
    """`KimiK3Config` from `path/config.json`; every problem (not JSON, not an object, an unsupported
    or invalid field) is a CheckpointError naming the file and the field."""
    cpath = os.path.join(path, "config.json")
    if not os.path.exists(cpath):
        raise CheckpointError(f"checkpoint: no config.json in {path}")
    try:
        with open(cpath) as f:
            raw = json.load(f)
    except OSError as e:  # a directory named config.json, no permission
        raise CheckpointError(f"{cpath}: cannot read ({e.strerror or e})") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CorruptCheckpointError(f"{cpath}: not valid JSON ({e})") from None
    if not isinstance(raw, Mapping):
        raise CorruptCheckpointError(f"{cpath}: must be a JSON object, got {json_type(raw)}")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else raw
    mt = text.get("model_type")
    if mt not in (None, "kimi_linear", "kimi_k3"):
        raise UnsupportedConfigError(f"{cpath}: model_type = {mt!r} is not supported (the text model must be "
                                     "'kimi_linear')")
    try:
        _check_quantization(text.get("quantization_config", raw.get("quantization_config")))
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{cpath}: {str(e).removeprefix('config.json: ')}") from None
    except (AttributeError, TypeError) as e:  # a part of it that is not an object where one belongs
        raise UnsupportedConfigError(f"{cpath}: quantization_config is malformed ({e})") from None
    # num_nextn_predict_layers (MTP) only adds tensors the decode step never reads: ignored.
    try:
        return KimiK3Config.from_pretrained(raw)
    except ValueError as e:
        raise UnsupportedConfigError(f"{cpath}: {str(e).removeprefix('config: ')}") from None


# ------------------------------------------------------------------------- the load plan
def _norm_index(idx: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    out = []
    for s, n in zip(tuple(idx) + (slice(None),) * (len(shape) - len(idx)), shape):
        a, b, st = s.indices(n)
        assert st == 1, idx
        out.append((a, b))
    return tuple(out)


def _sl(blk) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in blk)


class SafetensorsSource:
    """The tensors of a checkpoint directory (model-side names); reads slices through safe_open,
    one open handle per file."""

    def __init__(self, tensors: Mapping[str, TensorInfo]):
        self.prefixed = any(k.startswith("language_model.") for k in tensors)
        self.tensors = _internal_names(tensors)
        self._handles: dict[str, Any] = {}

    def info(self, name: str) -> TensorInfo | None:
        return self.tensors.get(name)

    def read(self, info: TensorInfo, idx: tuple) -> np.ndarray:
        h = self._handles.get(info.file)
        if h is None:
            try:
                h = self._handles[info.file] = safe_open(info.file, framework="numpy")
            except Exception as e:  # safetensors raises its own SafetensorError
                raise CorruptCheckpointError(f"{os.path.basename(info.file)}: cannot open ({e})") from None
        return np.asarray(h.get_slice(info.name)[idx])

    def display(self, name: str) -> str:
        return ("language_model." + name) if self.prefixed else name

    def close(self) -> None:
        self._handles.clear()


_NP_TAGS = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.float16): "F16",
            np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}


class ArraySource(SafetensorsSource):
    """Host arrays keyed by checkpoint name (the same names and checks as a checkpoint directory)."""

    def __init__(self, flat: Mapping[str, Any]):
        arrays = {k: np.asarray(v) for k, v in flat.items()}
        infos = {}
        for k, a in arrays.items():
            tag = "BF16" if a.dtype.name == "bfloat16" else _NP_TAGS.get(a.dtype, a.dtype.name.upper())
            infos[k] = TensorInfo(k, "<memory>", tag, tuple(a.shape))
        super().__init__(infos)
        self._arrays = arrays  # by the names given (TensorInfo.name)

    def read(self, info: TensorInfo, idx: tuple) -> np.ndarray:
        return self._arrays[info.name][idx]


class _Leaf:
    """One placed weight: its `Param` and how to read any block of its model-layout array."""

    def __init__(self, param: Param, read: Callable[[tuple[tuple[int, int], ...]], np.ndarray]):
        self.param, self.shape, self.read = param, param.shape, read


def _dense(src, info: TensorInfo, param: Param) -> _Leaf:
    if param.source == "plain":
        return _Leaf(param, lambda blk: src.read(info, _sl(blk)))
    n = info.shape[0]  # pad_rows: zero rows past the checkpoint's

    def read(blk):
        (a, b), rest = blk[0], blk[1:]
        cols = tuple(e - s for s, e in rest)
        got = src.read(info, _sl(((a, min(b, n)),) + rest)) if a < n else np.zeros((0,) + cols, np.float32)
        return got if b <= n else np.concatenate([got, np.zeros((b - max(a, n),) + cols, got.dtype)])
    return _Leaf(param, read)


def _a_log(src, info: TensorInfo, param: Param) -> _Leaf:
    def read(blk):
        (a, b), = blk
        if len(info.shape) == 1:
            return src.read(info, (slice(a, b),))
        return src.read(info, (slice(0, 1), slice(0, 1), slice(a, b), slice(0, 1))).reshape(-1)
    return _Leaf(param, read)


def _checked_scales(name: str, sc: np.ndarray, blk) -> np.ndarray:
    """`sc`, an E8M0 block read from tensor `name` at `blk`; the NaN code 255 is a NonFiniteTensorError
    naming the tensor and the index (always checked: no weight can use it)."""
    if np.any(sc == mxfp4.SCALE_NAN):
        at = _model_index(np.argwhere(sc == mxfp4.SCALE_NAN)[0], blk)
        raise NonFiniteTensorError(f"checkpoint: tensor {name!r} holds the E8M0 scale byte "
                                   f"{mxfp4.SCALE_NAN} (NaN in the MX format) at {at}")
    return sc


def _model_index(pos, blk) -> list[int]:
    """A position inside block `blk` ((start, stop) per dim) as the index in the whole tensor."""
    return [int(p) + a for p, (a, _) in zip(pos, blk)]


def _mxfp4_part(src, packed: TensorInfo, scale: TensorInfo) -> Callable[[tuple], np.ndarray]:
    def read(blk):
        (r0, r1), (c0, c1) = blk
        p0, p1 = c0 // 2, -(-c1 // 2)
        g0, g1 = c0 // mxfp4.GROUP, -(-c1 // mxfp4.GROUP)
        sc = _checked_scales(scale.name, src.read(scale, (slice(r0, r1), slice(g0, g1))), ((r0, r1), (g0, g1)))
        w = mxfp4.dequantize(src.read(packed, (slice(r0, r1), slice(p0, p1))), sc,
                             np.float32, col_offset=2 * p0 - mxfp4.GROUP * g0)
        return w[:, c0 - 2 * p0: c1 - 2 * p0]
    return read


EXPERTS = ("auto", "mxfp4", "dense")


def resolve_experts(cfg: KimiK3Config, source, experts: str = "auto", tp: int = 1,
                    shard_latent: bool = True) -> KimiK3Config:
    """`cfg` with its `experts_format` for `source` at `tp`: "mxfp4" keeps the routed experts packed
    (the checkpoint must have them so, and each rank's share of w2's input columns must be whole
    32-column scale groups), "dense" holds them in the model dtype (MXFP4 ones dequantised at load),
    "auto" is "mxfp4" where the checkpoint's first routed expert is MXFP4 and the packed layout fits
    `tp`, else "dense".  ValueError names the argument and the dimension that does not fit."""
    check_experts(experts)
    if experts != "auto":
        try:
            out = dataclasses.replace(cfg, experts_format=experts)
            out.validate_tp(tp, shard_latent=shard_latent)
        except ValueError as e:
            raise ValueError(f"experts={experts!r}: {e}") from None
        return out
    if "moe" in cfg.layer_ffn:
        base = f"model.layers.{cfg.layer_ffn.index('moe')}.block_sparse_moe.experts.0.w1.weight"
        if source is not None and source.info(base + "_packed") is not None and source.info(base) is None:
            try:
                return resolve_experts(cfg, source, "mxfp4", tp, shard_latent)
            except ValueError:
                pass  # the packed layout does not fit this TP: dequantise at load (experts="mxfp4" says why)
    return dataclasses.replace(cfg, experts_format="dense")


def check_experts(experts: Any) -> str:
    if experts not in EXPERTS:
        raise ValueError(f"experts: must be one of {EXPERTS}, got {experts!r}")
    return experts


def build_plan(cfg: KimiK3Config, source, tp: int):
    """A `Weights` pytree of `_Leaf`s for `source` (a SafetensorsSource or ArraySource): finds every
    declared weight by its checkpoint names and checks its name, shape and dtype first (raises
    CheckpointError subclasses before any tensor data is read)."""
    def find(p: Param, name: str | None = None) -> TensorInfo:
        for n in ((name,) if name else p.names):
            t = source.info(n)
            if t is not None:
                return t
        want = name or p.name
        if want.endswith(".weight") and source.info(want[: -len("weight")] + "weight_packed") is not None:
            raise UnsupportedConfigError(
                f"checkpoint: {source.display(want[: -len('.weight')])!r} is quantised (weight_packed); only the "
                "routed experts may be MXFP4 in this port")
        also = f" (nor {', '.join(repr(source.display(n)) for n in p.names[1:])})" if len(p.names) > 1 and not name else ""
        raise MissingTensorError(f"checkpoint: missing tensor {source.display(want)!r}{also}")

    def check(t: TensorInfo, shape, dtypes=DENSE_DTYPES) -> TensorInfo:
        if t.dtype not in dtypes:
            raise TensorDtypeError(f"checkpoint: tensor {t.name!r} has dtype {t.dtype}; this weight must be one "
                                   f"of {', '.join(dtypes)}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise TensorShapeError(f"checkpoint: tensor {t.name!r} has shape {list(t.shape)}, expected "
                                   f"{list(shape)}")
        return t

    def expert(p: Param, name: str) -> Callable[[tuple], np.ndarray]:
        shape = p.checkpoint_shape
        if p.dtype == "uint8":  # experts_format "mxfp4": the bytes as stored
            t = source.info(name)
            if t is None:
                dense = name[: name.rindex(".weight_") + len(".weight")]
                if source.info(dense) is not None:
                    raise UnsupportedConfigError(
                        f"checkpoint: {source.display(dense)!r} is a dense expert weight: experts='mxfp4' needs "
                        f"MXFP4 experts (weight_packed + weight_scale); load with experts='dense'")
                raise MissingTensorError(f"checkpoint: missing tensor {source.display(name)!r}")
            t = check(t, shape, ("U8",))
            if p.init != "e8m0":
                return lambda blk: source.read(t, _sl(blk))
            return lambda blk: _checked_scales(t.name, source.read(t, _sl(blk)), blk)
        t = source.info(name)
        if t is not None:
            t = check(t, shape)
            return lambda blk: source.read(t, _sl(blk))
        base = name[: -len(".weight")]
        if source.info(base + ".weight_packed") is None:
            raise MissingTensorError(f"checkpoint: missing tensor {source.display(name)!r} "
                                     f"(nor MXFP4 {source.display(base + '.weight_packed')!r})")
        rows, cols = shape
        if cols % mxfp4.GROUP:
            raise UnsupportedConfigError(f"checkpoint: {base} has {cols} input columns, not a multiple of the "
                                         f"MXFP4 group {mxfp4.GROUP}")
        packed = check(source.info(base + ".weight_packed"), (rows, cols // 2), ("U8",))
        scale = check(find(p, base + ".weight_scale"), (rows, cols // mxfp4.GROUP), ("U8",))
        return _mxfp4_part(source, packed, scale)

    def leaf(p: Param) -> _Leaf:
        if p.source == "experts":
            parts = [expert(p, n) for n in params.expert_names(p, p.shape[0])]
            return _Leaf(p, lambda blk: np.stack([parts[e](blk[1:]) for e in range(*blk[0])]))
        t = find(p)
        if p.source == "a_log":
            check(t, None)  # dtype only
            H = p.shape[0]
            if not ((len(t.shape) == 1 and t.shape[0] >= H) or tuple(t.shape) == (1, 1, H, 1)):
                raise TensorShapeError(f"checkpoint: tensor {t.name!r} has shape {list(t.shape)}, expected [{H}] "
                                       f"(or [N >= {H}], of which the first {H} are used, or [1, 1, {H}, 1])")
            return _a_log(source, t, p)
        return _dense(source, check(t, p.checkpoint_shape), p)

    return jax.tree.map(leaf, abstract_weights(cfg, tp), is_leaf=params.is_param)


def plan_from_arrays(abstract, host) -> Any:
    """A plan over a host `Weights` tree already in model layout (vocab tables re-padded if their
    row count differs: rows past the vocabulary are zero)."""
    def leaf(p: Param, a) -> _Leaf:
        a = np.asarray(a)
        if a.shape != p.shape and not (p.source == "pad_rows" and a.shape[1:] == p.shape[1:]
                                       and a.shape[0] >= p.checkpoint_shape[0]):
            raise TensorShapeError(f"weights: {p.name!r} has shape {list(a.shape)}, expected {list(p.shape)}")
        if a.shape != p.shape:
            V = p.checkpoint_shape[0]
            a = np.concatenate([a[:V], np.zeros((p.shape[0] - V,) + a.shape[1:], a.dtype)])
        return _Leaf(p, lambda blk: a[_sl(blk)])

    return jax.tree.map(leaf, abstract, host, is_leaf=params.is_param)


def _leaves(plan) -> list[_Leaf]:
    return jax.tree.leaves(plan, is_leaf=lambda x: isinstance(x, _Leaf))


def read_all(plan) -> Any:
    """The plan's arrays, whole, on the host (checkpoint dtypes; MXFP4 experts dequantised to fp32)."""
    return jax.tree.map(lambda leaf: leaf.read(tuple((0, n) for n in leaf.shape)), plan,
                        is_leaf=lambda x: isinstance(x, _Leaf))


# ------------------------------------------------------------------------------ placing
_EXPONENT = {2: (np.uint16, 0x7F80), 4: (np.uint32, 0x7F800000), 8: (np.uint64, 0x7FF0000000000000)}


def _all_finite(block: np.ndarray) -> bool:
    """No NaN or Inf in a float block: every exponent field short of all ones, tested on the bits
    (3-4x faster than np.isfinite for bfloat16, whose ufuncs go through ml_dtypes)."""
    if block.dtype.kind != "f" and block.dtype.name != "bfloat16":
        return True
    if block.dtype == np.float16:
        v, m = block.view(np.uint16), np.uint16(0x7C00)
    else:
        u, mask = _EXPONENT[block.dtype.itemsize]
        v, m = block.view(u), u(mask)
    return not np.any((v & m) == m)


def place_plan(plan, mesh, dtype, shard_latent: bool, progress: Callable[[int, int], None] | None = None,
               check_finite: bool = True):
    """Every `_Leaf` -> a jax.Array sharded as its Param says, each device's block read on its own.
    `check_finite`: every block read is checked for NaN/Inf (NonFiniteTensorError names the tensor)."""
    from jax.sharding import NamedSharding

    total = sum(math.prod(leaf.shape) * leaf.param.np_dtype(dtype).itemsize for leaf in _leaves(plan))
    done = 0

    def put(leaf: _Leaf):
        nonlocal done
        dt = leaf.param.np_dtype(dtype)
        sharding = NamedSharding(mesh, leaf.param.pspec(shard_latent))
        last: list = [None, None]  # (block, host array): replicated blocks are read once for all devices
        shards = []
        for dev, idx in sharding.addressable_devices_indices_map(leaf.shape).items():
            blk = _norm_index(idx, leaf.shape)
            if last[0] != blk:
                last[:] = [None, None]  # drop the previous rank's slice before reading the next
                block = np.asarray(leaf.read(blk))
                if check_finite and not _all_finite(block):
                    bad = np.argwhere(~np.isfinite(block))[0]
                    raise NonFiniteTensorError(f"checkpoint: tensor {leaf.param.name!r} holds "
                                               f"{block[tuple(bad)]} at model index {_model_index(bad, blk)} (NaN/Inf)")
                last[:] = [blk, np.ascontiguousarray(block.astype(dt, copy=False))]
            # one rank's slice to its device; wait, so at most one slice is held on the host
            shards.append(jax.device_put(last[1], dev).block_until_ready())
        last[:] = [None, None]
        arr = jax.make_array_from_single_device_arrays(leaf.shape, sharding, shards)
        done += math.prod(leaf.shape) * dt.itemsize
        if progress is not None:
            progress(done, total)
        return arr

    return jax.tree.map(put, plan, is_leaf=lambda x: isinstance(x, _Leaf))


def mark_experts_f16(cfg: KimiK3Config, weights):
    """(cfg, weights) with `experts_f16` set where the MXFP4 experts' scales all lie in the float16-exact range
    (`moe_experts.F16_SCALES`: checked on the loaded arrays), and each MXFP4 stack declaring it (`MXFP4.f16`), so
    that the step's weight specs (from the config) and the arrays agree; as they were otherwise."""
    f16 = cfg.experts_format == "mxfp4" and f16_exact(weights)
    if f16 == cfg.experts_f16:
        return cfg, weights
    return dataclasses.replace(cfg, experts_f16=f16), with_f16(weights, f16)


def load_weights(path: str | os.PathLike, mesh, dtype, shard_latent: bool = True,
                 progress: Callable[[int, int], None] | None = None, check_finite: bool = True,
                 experts: str = "auto") -> tuple[KimiK3Config, Any]:
    """(the config as loaded, the placed `Weights`) of a K3 / Kimi-Linear safetensors directory on
    `mesh` (jaxk3.load_model is the user-facing form; its docstring has the arguments).  Raises
    `CheckpointError` (subclasses named after the problem) before reading any tensor data, except
    `NonFiniteTensorError`, raised as the tensor is read."""
    path = os.fspath(path)
    if safe_open is None:
        raise CheckpointError("checkpoint: loading needs the `safetensors` package (pip install safetensors)")
    check_experts(experts)
    cfg = load_config(path)
    tp_size = mesh.shape[TP]
    source = SafetensorsSource(scan_checkpoint(path))
    cfg.validate_tp(tp_size, shard_latent=shard_latent)
    cfg = resolve_experts(cfg, source, experts, tp_size, shard_latent)
    plan = build_plan(cfg, source, tp_size)
    try:
        weights = place_plan(plan, mesh, dtype, shard_latent, progress, check_finite)
    finally:
        source.close()
    return mark_experts_f16(cfg, weights)


def weights_from_hf(cfg: KimiK3Config, flat: Mapping[str, Any]) -> Weights:
    """Host `Weights` (numpy; vocab tables padded for TP 1) from arrays keyed by checkpoint name.
    Raises the loader's named errors (missing tensor, wrong shape, unsupported dtype)."""
    return read_all(build_plan(cfg, ArraySource(flat), tp=1))


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
