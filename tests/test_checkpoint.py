"""Checkpoint loading (jaxk3.checkpoint) and MXFP4 (jaxk3.mxfp4) on tiny checkpoints written here in the
real layouts: K3 (nested text_config, `language_model.` prefix, vision tensors, compressed-tensors MXFP4
experts, A_log [2H]) sharded over 3 files with an index, and Kimi-Linear (flat, bf16, one file).

Loaded weights must equal `Model.from_weights` on the same (dequantised) arrays bit for bit, with the
same shardings, and generate the same tokens.  MXFP4 is checked against compressed-tensors' own
decompressor.  Slice reads are instrumented to prove each rank reads only its slice.
"""
import json
import re
import os
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxk3
from jaxk3 import checkpoint as ck
from jaxk3 import mxfp4
from jaxk3.config import KimiK3Config
from jaxk3.engine import Model
from jaxk3.model import random_hf_weights
from small_models import tiny_k3_4l


# ------------------------------------------------------------------------------ helpers
def _quantize_experts(cfg, flat, seed=1):
    """Replace every routed expert weight by random MXFP4 (packed, scale); flat gets the dequantised values."""
    rng = np.random.default_rng(seed)
    packed_all = {}
    for name in [k for k in flat if ".experts." in k]:
        r, c = flat[name].shape
        packed = rng.integers(0, 256, (r, c // 2), dtype=np.uint8)
        scale = rng.integers(118, 124, (r, c // 32), dtype=np.uint8)  # |w| ~ 2^-9 .. 6*2^-4
        packed_all[name[: -len(".weight")]] = (packed, scale)
        flat[name] = mxfp4.dequantize(packed, scale)
    return packed_all


def write_k3(path, cfg=None, shards=3, seed=0, a_log_extra=True):
    """Tiny K3 checkpoint in the real layout; returns (cfg, reference flat float32 weights)."""
    cfg = cfg or KimiK3Config.tiny_k3()
    flat = random_hf_weights(cfg, seed)
    packed = _quantize_experts(cfg, flat)
    disk = dict(flat)
    if a_log_extra:  # K3 headers list A_log as [128] for 96 heads: only the first H are used (docs/SPEC.md §2)
        rng = np.random.default_rng(seed + 7)
        for k in [k for k in flat if k.endswith("A_log")]:
            disk[k] = np.concatenate([flat[k], rng.uniform(50, 60, flat[k].shape).astype(np.float32)])
    vision = {"vision_tower.encoder.blocks.0.wqkv.weight": np.ones((24, 8), np.float32),
              "mm_projector.proj.0.weight": np.ones((8, 8), np.float32)}
    ck.save_checkpoint(path, cfg, disk, k3_layout=True, mxfp4_experts=packed, num_shards=shards, extra=vision)
    return cfg, flat


def write_kimi_linear(path, seed=3):
    """Tiny Kimi-Linear checkpoint: flat names, bf16 weights (fp32 ones stay fp32), A_log [1,1,H,1], one file."""
    cfg = KimiK3Config.tiny_kimi_linear()
    flat = random_hf_weights(cfg, seed)
    disk = {}
    for k, v in flat.items():
        if k.endswith("A_log"):
            disk[k] = v.reshape(1, 1, -1, 1)
        elif k.endswith(("dt_bias", "conv1d.weight", "o_norm.weight", "correction_bias")):
            disk[k] = v
        else:
            disk[k] = v.astype(ml_dtypes.bfloat16)
            flat[k] = disk[k].astype(np.float32)  # the reference sees exactly what is on disk
    ck.save_checkpoint(path, cfg, disk)
    return cfg, flat


def assert_same_weights(a: Model, b: Model):
    la, lb = jax.tree_util.tree_leaves_with_path(a.weights), jax.tree_util.tree_leaves_with_path(b.weights)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype, (p, x.shape, y.shape, x.dtype, y.dtype)
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), p
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(p))


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3")
    cfg, flat = write_k3(str(d), tiny_k3_4l())  # the first four layers: every kind of tensor, less to compile
    return str(d), cfg, flat


# ------------------------------------------------------------------------------ MXFP4
def test_mxfp4_known_bytes():
    """Byte 0x21: low nibble 1 (0.5) is column 0, high nibble 2 (1.0) column 1; 0x97: 6 then -0.5;
    scale 128 = 2^1, 127 = 2^0, 255 = NaN."""
    packed = np.array([[0x21, 0x97] * 16], np.uint8)  # 64 values, 2 groups
    scale = np.array([[128, 127]], np.uint8)
    w = mxfp4.dequantize(packed, scale)
    assert w.shape == (1, 64)
    np.testing.assert_array_equal(w[0, :4], [1.0, 2.0, 12.0, -1.0])
    np.testing.assert_array_equal(w[0, 32:36], [0.5, 1.0, 6.0, -0.5])
    assert np.isnan(mxfp4.scales(np.array([255], np.uint8))[0])
    # a column slice that starts inside a group uses that group's scale
    np.testing.assert_array_equal(mxfp4.dequantize(packed[:, 8:24], scale[:, 0:2], col_offset=16), w[:, 16:48])


def test_mxfp4_matches_compressed_tensors():
    """Nibble order (low nibble first), E2M1 table and the E8M0 bias 127, bit for bit against
    compressed-tensors' own MXFP4 decompressor on random bytes (every code, scales 0..254)."""
    torch = pytest.importorskip("torch", reason="compressed-tensors needs torch (absent on the 3.12 leg)")
    pytest.importorskip("compressed_tensors", reason="pip install compressed-tensors to check MXFP4 against it")
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (96, 64), dtype=np.uint8)
    packed[0, :] = np.arange(64)  # a few fixed bytes too
    packed[1, :] = np.arange(192, 256)
    scale = rng.integers(0, 255, (96, 4), dtype=np.uint8)
    scale[0] = [0, 127, 128, 254]

    ref_vals = unpack_fp4_from_uint8(torch.from_numpy(packed), 96, 128, dtype=torch.float32).numpy()
    np.testing.assert_array_equal(mxfp4.unpack_e2m1(packed), ref_vals)
    all_s = np.arange(255, dtype=np.uint8)
    np.testing.assert_array_equal(mxfp4.scales(all_s), decompress_mx_scale(torch.from_numpy(all_s)).float().numpy())

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    assert scheme.weights.group_size == mxfp4.GROUP
    out = MXFP4PackedCompressor.decompress(
        {"weight_packed": torch.from_numpy(packed), "weight_scale": torch.from_numpy(scale)}, scheme)
    ref = out["weight"].float().numpy()
    ours = mxfp4.dequantize(packed, scale, np.float32)
    assert ours.shape == ref.shape == (96, 128)
    np.testing.assert_array_equal(ours, ref)
    # and to bfloat16 (what the loader makes by default): compressed-tensors decompresses in bf16
    np.testing.assert_array_equal(mxfp4.dequantize(packed, scale, ml_dtypes.bfloat16).astype(np.float32), ref)


# ------------------------------------------------------------------------------ loading
def test_k3_sharded_mxfp4_loads_and_generates_like_in_memory(k3_dir):
    path, cfg, flat = k3_dir
    assert os.path.exists(os.path.join(path, ck.INDEX_FILE))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) == 3
    hdr = ck.scan_checkpoint(path)
    assert any(k.endswith("experts.0.w1.weight_packed") and v.dtype == "U8" for k, v in hdr.items())
    assert all(k.startswith(("language_model.", "vision_tower.", "mm_projector.")) for k in hdr)
    assert ck.load_config(path) == cfg
    m = jaxk3.load_model(path, tp=4, dtype="float32", gather="lax")
    ref = Model.from_weights(cfg, flat, tp=4, dtype="float32", gather="lax")
    assert_same_weights(m, ref)
    prompt = [[5, 17, 900, 3], [42, 7, 1, 999]]
    a = m.generate(prompt, 3, return_logits=True)
    b = ref.generate(prompt, 3, return_logits=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logits, b.logits)


def test_k3_a_log_uses_first_num_heads(k3_dir):
    """docs/SPEC.md §2: the header says A_log [128] for 96 heads; vLLM uses the first 96.  Here [2H] on disk, H used."""
    path, cfg, flat = k3_dir
    hdr = ck.scan_checkpoint(path)
    l = cfg.kda_layers[0]
    info = hdr[f"language_model.model.layers.{l}.self_attn.A_log"]
    assert info.shape == (2 * cfg.kda_num_heads,)
    m = jaxk3.load_model(path, tp=8, dtype="bfloat16")
    a = np.asarray(m.weights.layers[l].attn.A_log)
    assert a.shape == (cfg.kda_num_heads,) and a.dtype == np.float32
    np.testing.assert_array_equal(a, flat[f"model.layers.{l}.self_attn.A_log"])
    assert np.all(a < np.log(16.0) + 1e-6)  # none of the [H:] tail (50..60) leaked in
    assert m.weights.layers[1].ffn.experts_w1.dtype == jax.numpy.bfloat16  # MXFP4 dequantised to the dtype


def test_kimi_linear_single_file_bf16(tmp_path):
    """Flat Kimi-Linear naming, one file, bf16 on disk: the same arrays, dtypes and shardings as
    `Model.from_weights` (so the same decode program and tokens; generation is compared in the K3 test)."""
    cfg, flat = write_kimi_linear(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert ck.scan_checkpoint(str(tmp_path))["model.layers.0.self_attn.A_log"].shape == (1, 1, cfg.kda_num_heads, 1)
    m = jaxk3.load_model(str(tmp_path), tp=2, dtype="bfloat16", gather="lax")
    ref = Model.from_weights(cfg, flat, tp=2, dtype="bfloat16", gather="lax")
    assert_same_weights(m, ref)
    assert m.cfg == cfg and m.weights.layers[0].attn.g_a_proj is not None and m.weights.output_attn_res_norm is None


# ------------------------------------------------------------------------------ memory
def _declared(cfg, name: str):
    """The Param a checkpoint tensor is declared by (experts by their `{e}` pattern)."""
    from jaxk3 import params
    from jaxk3.model import abstract_weights

    n = name[len("language_model."):] if name.startswith("language_model.") else name
    n = "model." + n if n.startswith("layers.") else n
    n = re.sub(r"experts\.\d+\.", "experts.{e}.", n)
    n = re.sub(r"\.weight_(packed|scale)$", ".weight", n)  # MXFP4 experts
    return {q: p for p in params.params(abstract_weights(cfg)) for q in p.names}[n]


def test_loading_reads_only_each_ranks_slice(tmp_path, monkeypatch):
    """Every slice read is logged (name, bytes), and every device_put.  A tensor the table shards is read as
    exactly tp slices of nbytes/tp each (MXFP4 packed and scale tensors included; never the whole tensor); a
    replicated one once.  Host memory: the bytes read between two device_puts never exceed what the second
    put sends to its one device, i.e. one rank's slice is read, placed, and only then the next one read."""
    tp = 8
    cfg = KimiK3Config.tiny_k3(moe_intermediate_size=256)  # 32 expert columns per rank = one MXFP4 group
    write_k3(str(tmp_path), cfg=cfg, shards=2)
    reads: list[tuple[str, int]] = []
    events: list[tuple[str, int]] = []
    real_open, real_put = ck.safe_open, jax.device_put

    class Slice:
        def __init__(self, s, name):
            self.s, self.name = s, name

        def __getitem__(self, idx):
            out = self.s[idx]
            reads.append((self.name, np.asarray(out).nbytes))
            events.append(("read", np.asarray(out).nbytes))
            return out

    class Handle:
        def __init__(self, *a, **k):
            self.h = real_open(*a, **k)

        def get_slice(self, name):
            return Slice(self.h.get_slice(name), name)

    def put(x, device=None, *a, **k):
        assert isinstance(device, jax.Device), "a weight went to a sharding, not one device"
        events.append(("put", np.asarray(x).nbytes))
        return real_put(x, device, *a, **k)

    monkeypatch.setattr(ck, "safe_open", Handle)
    monkeypatch.setattr(jax, "device_put", put)
    m = jaxk3.load_model(str(tmp_path), tp=tp, dtype="float32")  # fp32 on disk: a put's bytes = its slice's
    monkeypatch.setattr(jax, "device_put", real_put)
    n_leaves = len(jax.tree_util.tree_leaves(m.weights))
    assert sum(e == "put" for e, _ in events) == n_leaves * tp
    pending = 0
    for kind, nbytes in events:
        if kind == "read":
            pending += nbytes
        else:
            assert pending <= nbytes, (pending, nbytes)
            pending = 0
    assert pending == 0
    hdr = ck.scan_checkpoint(str(tmp_path))
    by_name: dict[str, list[int]] = {}
    for n, b in reads:
        by_name.setdefault(n, []).append(b)
    assert not any(n.startswith(("vision_tower", "mm_projector")) for n in by_name)
    n_sharded = 0
    for name, info in hdr.items():
        if name.startswith(("vision_tower", "mm_projector")):
            continue
        got = by_name.get(name)
        assert got, f"{name} never read"
        param = _declared(cfg, name)
        key = param.name
        sharded = param.pspec(True) != P()
        full = info.nbytes
        if param.source == "a_log":  # [2H] on disk: each rank reads its H/tp entries of the first H
            assert got == [cfg.kda_num_heads // tp * 4] * tp, (name, got)
        elif param.source == "pad_rows":  # vocab 1000 padded to 1024: 7 x 128 rows + 104
            assert sorted(got) == sorted([full // cfg.vocab_size * 128] * 7 + [full // cfg.vocab_size * 104])
        elif sharded:
            n_sharded += 1
            assert got == [full // tp] * tp, (name, key, got, full)
        else:
            assert got == [full], (name, key, got, full)
    assert n_sharded > 100
    largest_rank_slice = max(b for _, b in reads)
    experts = cfg.num_experts * cfg.moe_intermediate_size * cfg.moe_hidden
    assert largest_rank_slice < experts // 2  # no read is the size of a whole (unsharded) expert stack


# ------------------------------------------------------------------------------ errors
def _rewrite_header(path: str, fn):
    """Apply fn(header dict) to a safetensors file's header, keeping the data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        hdr = json.loads(f.read(n))
        data = f.read()
    fn(hdr)
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def _file_of(path, name):
    with open(os.path.join(path, ck.INDEX_FILE)) as f:
        return os.path.join(path, json.load(f)["weight_map"][name])


@pytest.fixture
def k3_copy(tmp_path):
    cfg, _ = write_k3(str(tmp_path), seed=5)
    return str(tmp_path), cfg


def _no_reads(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("tensor data was opened before the checkpoint was validated")
    monkeypatch.setattr(ck, "safe_open", boom)


def test_error_missing_tensor(k3_copy, monkeypatch):
    path, _ = k3_copy
    name = "language_model.model.layers.2.self_attn.q_proj.weight"
    with open(os.path.join(path, ck.INDEX_FILE)) as f:
        idx = json.load(f)
    fn = idx["weight_map"].pop(name)
    with open(os.path.join(path, ck.INDEX_FILE), "w") as f:
        json.dump(idx, f)
    _rewrite_header(os.path.join(path, fn), lambda h: h.pop(name))
    _no_reads(monkeypatch)
    with pytest.raises(ck.MissingTensorError, match=r"missing tensor 'language_model\.model\.layers\.2\.self_attn"
                                                    r"\.q_proj\.weight'"):
        jaxk3.load_model(path, tp=2)


def test_error_missing_mxfp4_scale(k3_copy, monkeypatch):
    path, _ = k3_copy
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    with open(os.path.join(path, ck.INDEX_FILE)) as f:
        idx = json.load(f)
    fn = idx["weight_map"].pop(name)
    with open(os.path.join(path, ck.INDEX_FILE), "w") as f:
        json.dump(idx, f)
    _rewrite_header(os.path.join(path, fn), lambda h: h.pop(name))
    _no_reads(monkeypatch)
    with pytest.raises(ck.MissingTensorError, match=r"experts\.3\.w2\.weight_scale"):
        jaxk3.load_model(path, tp=2)


def test_error_quantised_non_expert(k3_copy, monkeypatch):
    """Only routed experts may be MXFP4: a packed shared-expert weight is an unsupported-config error."""
    path, _ = k3_copy
    name = "language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"
    with open(os.path.join(path, ck.INDEX_FILE)) as f:
        idx = json.load(f)
    fn = idx["weight_map"].pop(name)
    idx["weight_map"][name + "_packed"] = fn
    with open(os.path.join(path, ck.INDEX_FILE), "w") as f:
        json.dump(idx, f)
    _rewrite_header(os.path.join(path, fn), lambda h: h.update({name + "_packed": h.pop(name)}))
    _no_reads(monkeypatch)
    with pytest.raises(ck.UnsupportedConfigError, match=r"shared_experts\.up_proj' is quantised \(weight_packed\); "
                                                        "only the routed experts"):
        jaxk3.load_model(path, tp=2)


def test_error_wrong_shape(k3_copy, monkeypatch):
    path, cfg = k3_copy
    name = "language_model.model.layers.3.self_attn.kv_b_proj.weight"  # MLA layer 3; [H*(n+v), R] = [256, 32]

    def fn(h):
        h[name]["shape"] = [128, 64]  # same bytes, wrong shape
    _rewrite_header(_file_of(path, name), fn)
    _no_reads(monkeypatch)
    with pytest.raises(ck.TensorShapeError, match=r"kv_b_proj\.weight' has shape \[128, 64\], expected \[256, 32\]"):
        jaxk3.load_model(path, tp=2)


def test_error_a_log_too_short(k3_copy, monkeypatch):
    path, cfg = k3_copy
    name = "language_model.model.layers.0.self_attn.A_log"

    def fn(h):
        h[name]["shape"] = [4, 4]
    _rewrite_header(_file_of(path, name), fn)
    _no_reads(monkeypatch)
    with pytest.raises(ck.TensorShapeError, match=r"A_log' has shape \[4, 4\], expected \[8\]"):
        jaxk3.load_model(path, tp=2)


def test_error_unknown_dtype(k3_copy, monkeypatch):
    path, _ = k3_copy
    name = "language_model.model.norm.weight"

    def fn(h):
        h[name]["dtype"] = "Q3"
    _rewrite_header(_file_of(path, name), fn)
    _no_reads(monkeypatch)
    with pytest.raises(ck.TensorDtypeError, match=r"model\.norm\.weight' has unknown dtype 'Q3'"):
        jaxk3.load_model(path, tp=2)


def test_error_unsupported_dtype(k3_copy, monkeypatch):
    path, _ = k3_copy
    name = "language_model.model.norm.weight"  # F32 [256] -> I32 [256]: same bytes, not a float

    def fn(h):
        h[name]["dtype"] = "I32"
    _rewrite_header(_file_of(path, name), fn)
    _no_reads(monkeypatch)
    with pytest.raises(ck.TensorDtypeError, match=r"model\.norm\.weight' has dtype I32"):
        jaxk3.load_model(path, tp=2)


def test_error_truncated_file(k3_copy, monkeypatch):
    path, _ = k3_copy
    fp = _file_of(path, "language_model.model.norm.weight")
    size = os.path.getsize(fp)
    with open(fp, "r+b") as f:
        f.truncate(size - 1000)
    _no_reads(monkeypatch)
    with pytest.raises(ck.CorruptCheckpointError, match=rf"{os.path.basename(fp)}: tensor .* ends at data byte "
                                                       r"\d+ but the file holds only \d+ \(truncated file\)"):
        jaxk3.load_model(path, tp=2)
    with open(fp, "r+b") as f:
        f.truncate(100)  # inside the header
    with pytest.raises(ck.CorruptCheckpointError, match="header length field says"):
        jaxk3.load_model(path, tp=2)


def test_error_corrupt_header(k3_copy, monkeypatch):
    path, _ = k3_copy
    fp = _file_of(path, "language_model.model.norm.weight")
    with open(fp, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe garbage")
    _no_reads(monkeypatch)
    with pytest.raises(ck.CorruptCheckpointError, match=rf"{os.path.basename(fp)}: header is not valid"):
        jaxk3.load_model(path, tp=2)


def test_error_index_names_missing_shard(k3_copy):
    path, _ = k3_copy
    fp = _file_of(path, "language_model.model.norm.weight")
    os.remove(fp)
    with pytest.raises(ck.CorruptCheckpointError, match=rf"lists shard '{os.path.basename(fp)}'"):
        jaxk3.load_model(path, tp=2)


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["quantization_config"].update(quant_method="fp8"), "quantization_config.quant_method"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=16),
     "quantization_config.config_groups.group_0.weights.group_size"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
     "quantization_config.config_groups.group_0.format"),
    (lambda c: c["text_config"].update(model_type="deepseek_v3"), "model_type"),
    (lambda c: c["text_config"].update(mla_use_nope=False), "mla_use_nope"),
    (lambda c: c["text_config"].update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c["text_config"].update(moe_router_activation_func="softmax"), "moe_router_activation_func"),
])
def test_error_unsupported_config(k3_copy, monkeypatch, edit, field):
    path, _ = k3_copy
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    edit(c)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)
    _no_reads(monkeypatch)
    with pytest.raises(ck.UnsupportedConfigError, match=rf"config\.json: {field.replace('.', chr(92) + '.')}"):
        jaxk3.load_model(path, tp=2)


def test_error_not_a_checkpoint(tmp_path):
    with pytest.raises(ck.CheckpointError, match="no config.json"):
        jaxk3.load_model(str(tmp_path), tp=1)
    with pytest.raises(ck.CheckpointError, match="is not a directory"):
        ck.scan_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps(KimiK3Config.tiny_k3().to_hf_dict()))
    with pytest.raises(ck.CheckpointError, match=r"no \*\.safetensors files"):
        jaxk3.load_model(str(tmp_path), tp=1)


def test_error_tp_not_dividing(k3_dir, monkeypatch):
    path, _, _ = k3_dir
    _no_reads(monkeypatch)
    with pytest.raises(ValueError, match="not divisible by the TP size 3"):
        jaxk3.load_model(path, tp=3)
