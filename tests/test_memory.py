"""jaxk3.memory: bytes per rank from the abstract Param tree, checked against real placed arrays;
MXFP4 vs dense expert bytes; the full K3's H200 count; a checkpoint reported from headers only."""
import dataclasses
import json
import math
import time
from fractions import Fraction

import jax
import pytest

import jaxk3
from jaxk3 import checkpoint as ck
from jaxk3 import params
from jaxk3.tools import memory
from jaxk3.config import KimiK3Config
from jaxk3.kernels import kda_decode

from test_checkpoint import write_k3, write_kimi_linear  # noqa: E402


def _mxfp4(cfg):
    return dataclasses.replace(cfg, experts_format="mxfp4")


def placed_bytes(model) -> dict[str, int]:
    """By Param.group: the bytes of each weight's largest shard on the real devices."""
    out = {g: 0 for g in memory.GROUPS}

    def count(p, a):
        out[p.group] += params.shard_bytes(a)
        return p

    jax.tree.map(count, model.abstract, model.weights, is_leaf=params.is_param)
    return out


# ------------------------------------------------------------------ (a) against a placed model
@pytest.mark.parametrize("make", [KimiK3Config.tiny_k3, lambda: _mxfp4(KimiK3Config.tiny_k3()),
                                  KimiK3Config.tiny_kimi_linear], ids=["k3-dense", "k3-mxfp4", "kimi-linear"])
@pytest.mark.parametrize("tp", [1, 2])
def test_bytes_equal_placed_shards(make, tp):
    cfg = make()
    model = jaxk3.init_random_model(cfg, tp=tp)  # bfloat16
    assert model.cfg.experts_format == cfg.experts_format
    want = placed_bytes(model)
    got = memory.weight_bytes_per_rank(cfg, tp, "bfloat16")
    assert got == want
    assert got["moe_experts"] > 0 and got["kda"] > 0
    for batch in (1, 3, 100):  # 100 rows touch every expert
        k = batch * cfg.num_experts_per_token
        assert memory.step_bytes_per_rank(cfg, tp, batch) == {
            **{g: 0 for g in memory.GROUPS},
            **params.bytes_per_rank(model.abstract, model.weights, experts_touched=k, rows=batch)}
    assert memory.step_bytes_per_rank(cfg, tp, 100) == {**got, "embed": 100 * cfg.hidden_size * 2}
    # and the cache: the arrays Model.init_cache places, largest shard of each
    cache = model.init_cache(3, 40)
    assert memory.cache_bytes(cfg, 3, 40, tp) == sum(params.shard_bytes(a) for a in jax.tree.leaves(cache))


def test_tp_halves_sharded_groups_and_dtype_counts():
    cfg = KimiK3Config.tiny_k3()
    w1, w2 = memory.weight_bytes_per_rank(cfg, 1), memory.weight_bytes_per_rank(cfg, 2)
    assert w2["moe_experts"] * 2 == w1["moe_experts"] and w2["mlp"] * 2 == w1["mlp"]
    assert w2["moe_other"] == w1["moe_other"]  # router, bias, latent norm: replicated
    f32 = memory.weight_bytes_per_rank(cfg, 2, "float32")
    assert f32["mlp"] == 2 * w2["mlp"]
    assert f32["moe_other"] < 2 * w2["moe_other"]  # the fp32 e_score_correction_bias is 4 B either way
    latent_rep = memory.weight_bytes_per_rank(cfg, 2, shard_latent=False)
    assert latent_rep["moe_latent"] == w1["moe_latent"] == 2 * w2["moe_latent"]


# ------------------------------------------------------------------ (b) MXFP4 vs dense experts
def test_mxfp4_experts_are_4_25_over_16_of_bf16():
    k3 = KimiK3Config.k3()
    for tp in (1, 8, 16):
        dense = memory.weight_bytes_per_rank(k3, tp)
        packed = memory.weight_bytes_per_rank(_mxfp4(k3), tp)
        assert Fraction(packed["moe_experts"], dense["moe_experts"]) == Fraction(17, 64)  # (0.5 + 1/32) / 2
        assert dense["moe_experts"] / packed["moe_experts"] == pytest.approx(3.7647, abs=1e-4)
        assert {g: v for g, v in dense.items() if g != "moe_experts"} == \
            {g: v for g, v in packed.items() if g != "moe_experts"}
    # K3's routed experts: 92 MoE layers x 896 experts x 3 matrices of 3072 x 3584, all held
    n = 92 * 896 * 3 * 3072 * 3584
    assert memory.weight_bytes_per_rank(k3, 1)["moe_experts"] == 2 * n
    assert memory.weight_bytes_per_rank(_mxfp4(k3), 1)["moe_experts"] == n * 17 // 32


# ------------------------------------------------------------------ (c) the full K3
def test_k3_report_is_instant_and_h200_count_consistent():
    k3 = _mxfp4(KimiK3Config.k3())
    live = len(jax.live_arrays())
    t = time.perf_counter()
    d = memory.info(k3, 8, batch=1, context=8192)
    text = memory.format_report(d)
    assert time.perf_counter() - t < 15
    assert len(jax.live_arrays()) == live  # nothing placed on a device
    json.dumps(d)  # JSON-able
    usable = memory.usable_bytes()
    assert usable == int(141e9 * 0.9)
    assert not d["fits"] and d["weight_bytes_per_rank_total"] > usable  # TP 8 (one host) cannot hold K3
    for fmt, n_best, tp_best in (("mxfp4", 16, 16), ("dense", 96, 96)):
        h = d["h200"][fmt]
        cfg = dataclasses.replace(k3, experts_format=fmt)
        model_bytes = sum(memory.weight_bytes_per_rank(cfg, 1).values())  # the whole model, one copy
        best = h["fewest"]
        assert (best["gpus"], best["tp"]) == (n_best, tp_best)
        assert math.ceil(model_bytes / usable) <= best["gpus"]
        for l in h["by_tp"]:
            if l["fits"]:
                assert l["total_bytes"] <= usable and l["gpus"] >= n_best
                assert math.ceil(model_bytes / usable) <= l["gpus"]
                assert l["tp_spans_hosts"] == (l["tp"] > 8)
            elif not l["invalid"]:
                assert l["total_bytes"] > usable
        by_tp = {l["tp"]: l for l in h["by_tp"]}
        assert "kda num_heads = 96" in by_tp[64]["invalid"]
        assert by_tp[96]["shard_latent"] is False  # routed_expert_hidden_size 3584 does not split 96 ways
    assert "fewest: 16 H200s (TP 16 x DP 1, 2 hosts)" in text
    assert "fewest: 96 H200s (TP 96 x DP 1, 12 hosts)" in text
    assert "jax.distributed" in text and "single-process" in text


def test_dp_splits_the_cache():
    k3 = _mxfp4(KimiK3Config.k3())
    kw = dict(batch=64, context=131072)
    table = memory.min_gpus(k3, tps=(8, 16, 32), **kw)
    assert not table[8].fits  # weights alone: 196 GB per rank
    l16 = table[16]
    assert l16.fits and l16.dp > 1 and l16.gpus == 16 * l16.dp
    # one DP fewer does not fit: the smallest DP is found
    fewer = memory.layout(k3, 16, l16.dp - 1, **kw)
    assert not fewer.fits and fewer.total_bytes > memory.usable_bytes()
    assert l16.cache_bytes == k3.cache_bytes_per_rank(-(-64 // l16.dp), 131072, 16, 2, ring=kda_decode.RING)
    grid = memory.layouts(k3, tps=(16,), dps=(1, 2, 64), **kw)
    assert [(l.dp, l.rows_per_rank, l.fits) for l in grid] == [(1, 64, False), (2, 32, False), (64, 1, True)]
    assert len({l.weight_bytes for l in grid}) == 1  # DP replicates the weights


def test_bad_arguments():
    cfg = KimiK3Config.tiny_k3()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="tp"):
            memory.weight_bytes_per_rank(cfg, bad)
        with pytest.raises(ValueError, match="batch"):
            memory.info(cfg, 1, batch=bad)
    with pytest.raises(ValueError, match="dtype"):
        memory.weight_bytes_per_rank(cfg, 1, "int8")
    d = memory.info(cfg, 3)  # kda heads 8 do not split 3 ways: reported, not raised
    assert "not divisible by the TP size 3" in d["invalid"] and d["weight_bytes_per_rank"] is None
    assert "cannot run this model" in memory.format_report(d)


# ------------------------------------------------------------------ (d) a checkpoint directory
@pytest.fixture
def no_tensor_reads(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("tensor data read")

    monkeypatch.setattr(ck.SafetensorsSource, "read", fail)
    monkeypatch.setattr(ck, "safe_open", fail)


def test_checkpoint_mxfp4_from_headers_only(tmp_path, no_tensor_reads):
    cfg, _ = write_k3(tmp_path / "k3", shards=2)
    d = memory.checkpoint_report(tmp_path / "k3", 2)
    assert d["experts"] == "mxfp4" and d["checkpoint"]["experts_on_disk"] == "mxfp4"
    assert d["weight_bytes_per_rank"] == memory.weight_bytes_per_rank(_mxfp4(cfg), 2)
    scanned = ck.scan_checkpoint(str(tmp_path / "k3"))
    assert d["checkpoint"]["bytes"] == sum(t.nbytes for t in scanned.values())
    assert "routed experts mxfp4" in memory.format_report(d)
    dense = memory.checkpoint_report(tmp_path / "k3", 2, experts="dense")  # dequantised at load
    assert dense["experts"] == "dense" and dense["checkpoint"]["experts_on_disk"] == "mxfp4"
    assert dense["weight_bytes_per_rank"]["moe_experts"] * 17 == d["weight_bytes_per_rank"]["moe_experts"] * 64


def test_checkpoint_dense_and_refused(tmp_path, no_tensor_reads):
    write_kimi_linear(tmp_path / "kl")
    d = memory.checkpoint_report(tmp_path / "kl", 1)
    assert d["experts"] == "dense" and d["checkpoint"]["experts_on_disk"] == "dense"
    with pytest.raises(ck.CheckpointError):  # its experts are not MXFP4: load_model would refuse too
        memory.checkpoint_config(tmp_path / "kl", experts="mxfp4")
    with pytest.raises(ck.CheckpointError, match="config.json"):
        memory.checkpoint_config(tmp_path)


def test_cli_info_configs(tmp_path, no_tensor_reads):
    assert memory.config_for("k3").experts_format == "mxfp4"  # K3 ships MXFP4 experts
    assert memory.config_for("k3", "dense").experts_format == "dense"
    assert memory.config_for("tiny").experts_format == "dense"
    assert memory.config_for("kimi-linear-48b").experts_format == "dense"
    write_k3(tmp_path / "k3", shards=1)  # its config.json declares mxfp4-pack-quantized
    assert memory.config_for(str(tmp_path / "k3")).experts_format == "mxfp4"
    assert memory.config_for(str(tmp_path / "k3" / "config.json")).experts_format == "mxfp4"
    d = memory.cli_info(config="k3", tp=16, batch=2, context=4096)
    assert d["fits"] and d["experts"] == "mxfp4" and d["checkpoint"] is None
    assert d["cache_bytes_per_rank"] == KimiK3Config.k3().cache_bytes_per_rank(2, 4096, 16, 2, ring=kda_decode.RING)
    assert "1 H200 (TP 1 x DP 1, 1 host)" in memory.format_report(memory.cli_info(config="tiny", tp=1))
    assert memory.cli_info(checkpoint=str(tmp_path / "k3"), tp=2)["checkpoint"]["experts_on_disk"] == "mxfp4"
    for bad in (dict(), dict(config="k3", checkpoint=str(tmp_path / "k3"))):
        with pytest.raises(ValueError, match="one of --checkpoint"):
            memory.cli_info(**bad)
    with pytest.raises(ValueError, match="experts"):
        memory.config_for("k3", "fp8")
