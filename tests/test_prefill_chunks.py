"""The prefill chunk `Model.generate` / `Model.score` pick (engine.auto_prefill_chunk) and the padded
layout it gives (engine.prefill_layout), and `jaxk3 bench generate`'s same-run baseline."""
from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from jaxk3 import engine, params
from jaxk3.model import abstract_weights
from jaxk3.tools.bench_decode import load_config

H200 = "NVIDIA H200"


def balance_tokens(cfg) -> float:
    """Tokens per dispatch at which a chunk's FLOPs (2 x the active weight elements per token) take as
    long as reading every weight once, on an H200 (written out here from the declared shapes)."""
    tree = abstract_weights(cfg, 1)
    k, E = cfg.num_experts_per_token, cfg.num_experts
    active = sum(math.prod(p.shape) * (k / E if p.source == "experts" else 1) * (2 if p.init == "e2m1" else 1)
                 for p in jax.tree.leaves(tree, is_leaf=params.is_param)
                 if len(p.shape) >= 2 and p.group not in ("embed", "lm_head") and p.init != "e8m0")
    size = {"compute": 2, "fp32": 4, "uint8": 1}
    nbytes = sum(math.prod(p.shape) * size[p.dtype] for p in jax.tree.leaves(tree, is_leaf=params.is_param)
                 if p.group not in ("embed", "lm_head"))
    return nbytes * engine.GPU_FLOP_PER_BYTE["H200"] / (2 * active)


def test_kimi_linear_48b_chunks_reach_the_balance_of_bytes_and_flops():
    """48B on an H200: ~2.9K tokens per dispatch balance 96.7 GB of weights against the active 2.7 B
    parameters per token.  One row takes its 4K prompt in one chunk, 8 rows take 1024 each (8192 tokens
    per dispatch: past the balance ties go to the larger chunk, measured faster); long prompts take
    shorter chunks, MLA's scores bounded."""
    cfg = load_config("kimi-linear-48b")
    n_star = balance_tokens(cfg)
    assert 2500 < n_star < 3500
    assert engine.auto_prefill_chunk(cfg, 1, 4096, H200) == 4096
    assert engine.auto_prefill_chunk(cfg, 8, 4096, H200) == 1024
    assert engine.auto_prefill_chunk(cfg, 2, 4096, H200) == 4096
    for rows in (1, 2, 4, 8):
        c = engine.auto_prefill_chunk(cfg, rows, 4096, H200)
        assert rows * c >= n_star, (rows, c)
    # a GPU not in the table is taken as an H200; a CPU keeps the default
    assert engine.auto_prefill_chunk(cfg, 8, 4096, "NVIDIA B200") == 1024
    assert engine.auto_prefill_chunk(cfg, 1, 4096, "cpu") == engine.DEFAULT_PREFILL_CHUNK


def test_long_prompts_keep_mla_scores_bounded():
    """The fp32 scores of one dispatch, rows x chunk x heads per rank x the padded prompt, stay within
    MAX_PREFILL_SCORE_BYTES unless the chunk is already the minimum; more ranks (fewer heads each)
    allow longer chunks."""
    for name in ("kimi-linear-48b", "k3"):
        cfg = load_config(name)
        for tp in (1, 8):
            for rows in (1, 2, 8):
                for T in (4096, 32768, 131072):
                    c = engine.auto_prefill_chunk(cfg, rows, T, H200, 2, tp)
                    padded, per = engine.prefill_layout(T, c)
                    score = rows * per * cfg.num_attention_heads / tp * padded * 4
                    assert score <= engine.MAX_PREFILL_SCORE_BYTES or c == engine.DEFAULT_PREFILL_CHUNK, (name, tp, rows, T)
    cfg = load_config("kimi-linear-48b")
    assert engine.auto_prefill_chunk(cfg, 1, 32768, H200) == 1024
    assert engine.auto_prefill_chunk(cfg, 8, 32768, H200) == engine.DEFAULT_PREFILL_CHUNK
    k3 = load_config("k3")
    assert engine.auto_prefill_chunk(k3, 1, 32768, H200, 2, 8) > engine.auto_prefill_chunk(k3, 1, 32768, H200, 2, 1)


def test_chunk_choice_bounds_and_padding():
    """Always a power of two in [256, 8192 / rows] (never below 256); a prompt a little past a chunk
    is taken whole (one dispatch of 5120 padded tokens) rather than as two full chunks; many rows keep
    the minimum."""
    cfg = load_config("kimi-linear-48b")
    for rows in (1, 3, 8, 32, 64):
        for T in (1, 63, 65, 700, 4096, 4100, 50000):
            c = engine.auto_prefill_chunk(cfg, rows, T, H200)
            assert c >= engine.DEFAULT_PREFILL_CHUNK and c & (c - 1) == 0, (rows, T, c)
            assert rows * c <= max(engine.MAX_PREFILL_TOKENS, rows * engine.DEFAULT_PREFILL_CHUNK), (rows, T, c)
    assert engine.auto_prefill_chunk(cfg, 1, 4100, H200) == 8192
    assert engine.prefill_layout(4100, 8192) == (5120, 5120)
    assert engine.auto_prefill_chunk(cfg, 32, 4096, H200) == engine.DEFAULT_PREFILL_CHUNK


@pytest.mark.parametrize("T,chunk,want", [(40, 256, (40, 40)), (100, 256, (128, 128)), (300, 256, (512, 256)),
                                          (700, 1024, (768, 768)), (1000, 1024, (1024, 1024)),
                                          (4100, 4096, (8192, 4096)), (3000, 4096, (3072, 3072)),
                                          (200, 576, (256, 256)), (570, 576, (576, 576))])
def test_prefill_layout(T, chunk, want):
    """Prompts past a chunk pad to a multiple of it; shorter ones to a multiple of 64·max(1, chunk // 512)
    (at most the chunk); up to 64 tokens the prompt itself."""
    assert engine.prefill_layout(T, chunk) == want
    padded, per = want
    assert padded >= T and padded % per == 0


def test_k3_balances_further_out_than_kimi_linear():
    """K3 has more weight bytes per active parameter (more, larger experts), so its balance lies
    further out; at TP 8 (12 heads a rank) one row takes its 4K prompt whole."""
    cfg = load_config("k3")
    assert balance_tokens(cfg) > balance_tokens(load_config("kimi-linear-48b"))
    assert engine.auto_prefill_chunk(cfg, 1, 4096, H200, 2, 8) == 4096


def test_model_picks_the_default_on_cpu_and_takes_an_override():
    """On the CPU `prefill_chunk=None` is the default chunk, and gives the tokens and logits of the
    explicit chunk; a bad override is named.  (The tiny K3's first four layers, tests/small_models.py: the
    chunk choice is the engine's, whatever the depth; the model's one prefill and decode loop compile sooner.)"""
    import jaxk3
    from small_models import tiny_k3_4l

    m = jaxk3.init_random_model(tiny_k3_4l(), seed=3, tp=1, dtype="float32")
    assert m.prefill_chunk_for(2, 5000) == engine.DEFAULT_PREFILL_CHUNK
    prompts = [[5, 6, 7, 8, 9] * 20, [3, 4] * 30]
    a = m.generate(prompts, 3, return_logits=True)
    b = m.generate(prompts, 3, return_logits=True, prefill_chunk=engine.DEFAULT_PREFILL_CHUNK)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logits, b.logits)
    with pytest.raises(ValueError, match="prefill_chunk: must be a positive multiple of 64"):
        m.generate(prompts, 3, prefill_chunk=100)


@pytest.mark.slow
def test_bench_generate_times_the_baseline_in_the_same_run(tmp_path):
    """`bench generate --baseline-chunk`: the kernels-off prefill at that chunk beside the picked one, same
    weights, one process; its row carries both TTFTs and their ratio.  The model is the tiny K3's first four
    layers (tests/small_models.py, as a config.json: every kind of layer; its rows do not depend on the
    depth, and its compiles are cheaper: 74 -> 52 CPU seconds)."""
    import json

    from jaxk3.tools import bench_generate as bg
    from small_models import tiny_k3_4l

    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_k3_4l().to_hf_dict()))
    res = bg.run(config=str(config), batches=(1,), prompt=130, new=2, experts=None, dtype="float32",
                 baseline_chunk=64, copy_bytes=1 << 20)
    assert res["layers"] == 4
    (row,) = res["rows"]
    assert row["prefill_chunk"] == engine.DEFAULT_PREFILL_CHUNK and res["prefill_chunk"] == "auto"
    assert row["baseline_chunk"] == 64 and row["baseline_ttft_s"] > 0 and row["ttft_s"] > 0
    assert row["ttft_speedup"] == pytest.approx(row["baseline_ttft_s"] / row["ttft_s"])
    assert "base TTFT s" in bg.table(res)


@pytest.mark.slow
def test_prefill_breakdown_places_the_device_time_in_blocks():
    """`bench generate --breakdown`: one profiled prefill, its time placed in the model's blocks (tiny:
    KDA and MLA layers, MoE and the dense MLP, embed and head), each kind's share of the placed time."""
    import jaxk3
    from jaxk3.tools import bench_generate as bg

    m = jaxk3.init_random_model(load_config("tiny"), seed=1, tp=2, dtype="float32")
    res = bg.prefill_breakdown(m, [[5, 6, 7] * 50], 64)
    if "unavailable" in res:
        pytest.skip(f"no profile on this machine: {res['unavailable']}")
    assert res["chunks"] == 3 and res["chunk"] == 64
    assert {"kda", "mla", "moe", "head"} <= set(res["us"]) and all(v > 0 for v in res["us"].values())
    assert sum(res["share"].values()) == pytest.approx(1.0)
    assert res["total_us"] >= sum(res["us"].values()) * (1 - 1e-9)
    assert "prefill by block" in bg.breakdown_line(1, res) and "moe" in bg.breakdown_line(1, res)


def test_init_cache_compiles_once_per_shape():
    """`Model.init_cache` (every generate and score makes one) builds the whole cache in one jitted function
    per (batch, positions): zeros in each buffer's sharding, compiled once however often it is called."""
    import jaxk3
    from jaxk3.params import buffer_specs
    from jaxk3.model import cache_abstract

    m = jaxk3.init_random_model(load_config("tiny"), seed=2, tp=2, dtype="float32")
    a, b = m.init_cache(2, 512), m.init_cache(2, 512)
    assert m._fns[("cache", 2, 512)]._cache_size() == 1
    specs = jax.tree.leaves(buffer_specs(cache_abstract(m.cfg, 2, 512), m.dp_axis),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    leaves = jax.tree.leaves(b)
    assert len(leaves) == len(specs) and len(jax.tree.leaves(a)) == len(leaves)
    for x, spec in zip(leaves, specs):
        assert x.sharding.spec == spec and not np.any(np.asarray(x))
    m.init_cache(4, 1024)
    assert ("cache", 4, 1024) in m._fns and m._fns[("cache", 2, 512)]._cache_size() == 1
