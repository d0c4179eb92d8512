"""The benchmarks on fake CPU devices: every column present, the chains / strategies agree.

Timings on CPU mean nothing here; these check that the benchmarks run end to end, that their
built-in agreement checks hold (gather chains bitwise equal, floor chains bitwise equal, the
three decode strategies choose the same greedy tokens) and that the JSON is well formed.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxk3 import bench, collectives


@pytest.mark.parametrize("n", [2, 4])
def test_bench_gather_all_impls(n):
    res = bench.bench_gather(sizes=(64, 1024), chain=8, repeats=2, devices=jax.devices()[:n])
    impls = {(r["bytes_per_rank"], r["impl"]) for r in res["rows"]}
    assert impls == {(b, i) for b in (64, 1024) for i in ("xla_floor", "ffi_floor", "lax", "ffi")}
    paths = {r["impl"]: r["path"] for r in res["rows"]}
    assert paths["ffi_floor"] == "local" and paths["ffi"].startswith("ffi:")
    table = bench.gather_table(res)
    assert "ffi_floor" in table and "ffi/ffi_floor" in table
    json.loads(json.dumps(res))


def test_local_tile_target_matches_tile():
    """The ffi_floor op writes what jnp.tile writes (the chain check relies on it)."""
    devs = jax.devices()[:2]
    mesh = jax.sharding.Mesh(np.asarray(devs), ("tp",))
    x = jnp.arange(2 * 37, dtype=jnp.float32).reshape(2, 37).astype(jnp.bfloat16)
    f = jax.jit(collectives.shard_map(lambda v: bench._local_tile(v, 3), mesh=mesh,
                                      in_specs=jax.sharding.PartitionSpec("tp"),
                                      out_specs=jax.sharding.PartitionSpec("tp")))
    want = np.concatenate([np.tile(np.asarray(x[i:i + 1]), (1, 3)) for i in range(2)])
    np.testing.assert_array_equal(np.asarray(f(x)), want)


def test_bench_decode_strategies_agree(tmp_path):
    from jaxk3 import bench_decode as bd

    res = bd.bench_decode(config="tiny", layers="2-5", experts=None, tp=2, batches=(1, 2), contexts=(64,),
                          steps=2, repeats=1, check_tokens=3, copy_bytes=1 << 20)
    path = tmp_path / "decode.json"
    bd.write_json(res, str(path))
    back = json.loads(path.read_text())
    assert back["kind"] == "decode" and back["layers"] == [2, 5]
    assert {(r["strategy"], r["batch"]) for r in back["rows"]} == {
        (s, b) for s, _, _ in bd.STRATEGIES for b in (1, 2)}
    for b in (1, 2):
        toks = {r["strategy"]: r["tokens"] for r in back["rows"] if r["batch"] == b}
        assert len(toks["stock"]) == 3 and all(len(t) == b for t in toks["stock"])
        assert toks["stock"] == toks["sharded+lax"] == toks["sharded+one-shot"], toks
    assert not back["notes"]
    rows = {r["strategy"]: r for r in back["rows"] if r["batch"] == 1}
    # the sharded latent reads half the latent rows per rank at TP 2; everything else is equal
    st, sh = rows["stock"]["census"]["weight_bytes_by_part"], rows["sharded+one-shot"]["census"]["weight_bytes_by_part"]
    assert sh["mla_latent"] * 2 == st["mla_latent"]
    assert {k: v for k, v in st.items() if k != "mla_latent"} == {k: v for k, v in sh.items() if k != "mla_latent"}
    assert rows["sharded+one-shot"]["gathers"]["latent"].startswith("ffi")
    assert rows["sharded+lax"]["gathers"]["latent"].startswith("lax")
    for r in back["rows"]:
        assert r["us_per_step"] > 0 and r["floor_us"] > 0 and r["ratio_to_floor"] > 0
    assert "sharded+one-shot" in bd.decode_table(back)


def test_layer_offset_follows_the_global_attn_res_schedule():
    """model.StepOptions.layer_offset (bench decode's layer slices): offset 0 is the plain model
    step; an offset moves the AttnRes block starts, so the same weights give other logits."""
    from jaxk3 import bench_decode as bd
    from jaxk3.config import KimiK3Config
    from jaxk3.model import Model, StepOptions, build_step

    cfg = KimiK3Config.tiny_k3()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("tp",))
    w = bd.random_weights(cfg, mesh, "float32", shard_latent=True)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    ids = jax.device_put(np.array([5, 9], np.int32), rep)
    valid = jax.device_put(np.ones(2, bool), rep)
    logits = {}
    for off in (0, 1, 3):
        step = build_step(cfg, StepOptions(layer_offset=off), mesh)
        logits[off] = np.asarray(step(w, bd.random_cache(cfg, mesh, "float32", 2, 64), ids, valid)[0])
    model = Model(cfg, w, mesh, jnp.float32, "auto", True)
    ref = np.asarray(model._step(w, bd.random_cache(cfg, mesh, "float32", 2, 64), ids, valid)[0])
    np.testing.assert_array_equal(logits[0], ref)
    assert all(np.isfinite(v).all() for v in logits.values())
    assert not np.array_equal(logits[0], logits[1]) and not np.array_equal(logits[0], logits[3])


def test_slice_config_keeps_kinds():
    from jaxk3 import bench_decode as bd
    from jaxk3.config import KimiK3Config

    k3 = KimiK3Config.k3()
    first, last = bd.parse_layers("11-14", k3)
    sub = bd.slice_config(k3, first, last, 32)
    assert sub.layer_attn == ("mla", "kda", "kda", "kda") and sub.layer_ffn == ("moe",) * 4
    assert sub.num_experts == 32 and sub.attn_res_block_size == 12
    assert "AttnRes block starts at [12]" in bd.describe_slice(sub, first, last)
    with pytest.raises(ValueError):
        bd.parse_layers("90-95", k3)
