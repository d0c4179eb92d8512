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

from jaxk3 import collectives
from jaxk3.tools import bench_gather as bench


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


@pytest.mark.slow
def test_bench_decode_strategies_agree(tmp_path):
    from jaxk3.tools import bench_decode as bd

    # one batch size (2: each strategy compiles its step once per batch) and two layers (3-4: MLA and KDA
    # attention, both MoE; the four of 2-5 took ~70 s for the four strategies on the CI machine)
    res = bd.bench_decode(config="tiny", layers="3-4", experts=None, tp=2, batches=(2,), contexts=(64,),
                          steps=2, repeats=1, check_tokens=3, copy_bytes=1 << 20)
    path = tmp_path / "decode.json"
    bd.write_json(res, str(path))
    back = json.loads(path.read_text())
    assert back["kind"] == "decode" and back["layers"] == [3, 4]
    assert {(r["strategy"], r["batch"]) for r in back["rows"]} == {(s.name, 2) for s in bd.STRATEGIES}
    for b in (2,):
        toks = {r["strategy"]: r["tokens"] for r in back["rows"] if r["batch"] == b}
        assert len(toks["stock"]) == 3 and all(len(t) == b for t in toks["stock"])
        assert toks["stock"] == toks["sharded+lax"] == toks["sharded+one-shot"], toks
    assert not back["notes"]
    for r in back["rows"]:  # the first greedy steps' top-2 margins, one per check step, a tie at 0
        assert len(r["top2_margin"]) == 3 and all(0.0 <= m <= 2.0 for m in r["top2_margin"]), r["top2_margin"]
        assert r["rerun_equal"] is True  # the step is deterministic on the CPU
    rows = {r["strategy"]: r for r in back["rows"] if r["batch"] == 2}
    # the sharded latent reads half the latent rows per rank at TP 2; everything else is equal
    st, sh = rows["stock"]["census"]["weight_bytes_by_part"], rows["sharded+one-shot"]["census"]["weight_bytes_by_part"]
    assert sh["mla_latent"] * 2 == st["mla_latent"]
    # the MoE latent projections (routed_expert_down/up_proj) follow shard_latent too: half at TP 2
    assert sh["moe_latent"] * 2 == st["moe_latent"] > 0
    latent = ("mla_latent", "moe_latent")
    assert {k: v for k, v in st.items() if k not in latent} == {k: v for k, v in sh.items() if k not in latent}
    # packed experts: the same layout with the routed experts' bytes at 4.25 of 16 bits (issue 17)
    pk = rows["packed+sharded+one-shot"]["census"]["weight_bytes_by_part"]
    assert pk["moe_experts"] * 64 == sh["moe_experts"] * 17
    assert {k: v for k, v in pk.items() if k != "moe_experts"} == {k: v for k, v in sh.items() if k != "moe_experts"}
    assert rows["packed+sharded+one-shot"]["floor_us"] < rows["sharded+one-shot"]["floor_us"]
    assert rows["sharded+one-shot"]["gathers"]["latent"].startswith("ffi")
    assert rows["sharded+lax"]["gathers"]["latent"].startswith("lax")
    for r in back["rows"]:
        assert r["us_per_step"] > 0 and r["floor_us"] > 0 and r["ratio_to_floor"] > 0
    assert "sharded+one-shot" in bd.decode_table(back)


@pytest.mark.slow  # the first suite only: three compiled steps; the newest jax runs layer offsets in
# test_census_more_layers_more_kernels (layers 3-4, 3-5) and test_bench_decode_kernel_modes (layers 6-7)
def test_layer_offset_follows_the_global_attn_res_schedule():
    """model.StepOptions.layer_offset (bench decode's layer slices): offset 0 is the plain model
    step; an offset moves the AttnRes block starts, so the same weights give other logits.  The tiny
    K3's first four layers (AttnRes blocks of 3: offset 0 starts them at layers 0 and 3, offset 1 at 2)."""
    import jaxk3
    from jaxk3.tools import bench_decode as bd
    from jaxk3.engine import Model
    from jaxk3.model import StepOptions, build_step
    from small_models import tiny_k3_4l

    cfg = tiny_k3_4l()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("tp",))
    # host-made random weights (the bench's device-side generator compiles one program per weight shape:
    # 34 -> 20 CPU seconds for this test; what is tested here is the step's schedule, not where its weights came from)
    w = jaxk3.init_random_model(cfg, seed=0, mesh=mesh, dtype="float32").weights
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    ids = jax.device_put(np.array([5, 9], np.int32), rep)
    valid = jax.device_put(np.ones(2, bool), rep)
    logits = {}
    for off in (0, 1):
        step = build_step(cfg, StepOptions(layer_offset=off), mesh)
        logits[off] = np.asarray(step(w, bd.random_cache(cfg, mesh, "float32", 2, 64), ids, valid)[0])
    model = Model(cfg, w, mesh, jnp.float32, "auto", True)
    ref = np.asarray(model._step(w, bd.random_cache(cfg, mesh, "float32", 2, 64), ids, valid)[0])
    np.testing.assert_array_equal(logits[0], ref)
    assert all(np.isfinite(v).all() for v in logits.values())
    assert not np.array_equal(logits[0], logits[1])


def test_slice_config_keeps_kinds():
    from jaxk3.tools import bench_decode as bd
    from jaxk3.config import KimiK3Config

    k3 = KimiK3Config.k3()
    first, last = bd.parse_layers("11-14", k3)
    sub = bd.slice_config(k3, first, last, 32)
    assert sub.layer_attn == ("mla", "kda", "kda", "kda") and sub.layer_ffn == ("moe",) * 4
    assert sub.num_experts == 32 and sub.attn_res_block_size == 12
    assert "AttnRes block starts at [12]" in bd.describe_slice(sub, first, last)
    with pytest.raises(ValueError):
        bd.parse_layers("90-95", k3)


# ------------------------------------------------------------------------ kernel census
SYNTHETIC_HLO = """HloModule jit_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%sorter (p: f32[4]) -> (f32[4], s32[4]) {
  %p = f32[4]{0} parameter(0)
  %i = s32[4]{0} iota(), iota_dimension=0
  ROOT %s = (f32[4]{0}, s32[4]{0}) sort(%p, %i), dimensions={0}, to_apply=%cmp
}

%command_buffer (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %f1 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/shard_map/layer1_moe/mul"}
  ROOT %f2 = f32[4]{0} fusion(%f1), kind=kInput, calls=%fused_a, metadata={op_name="jit(step)/shard_map/head/reduce_sum"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0), metadata={op_name="weights.embed_tokens"}
  %c = f32[] constant(0)
  %conv = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/shard_map"}
  %e = f32[4]{0} fusion(%conv), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/shard_map/embed/take"}
  %g = f32[4]{0} custom-call(%e, %x), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/shard_map/layer0_kda/dot_general"}
  %t = (f32[4]{0}, s32[4]{0}) fusion(%g), kind=kCustom, calls=%sorter, metadata={op_name="jit(step)/layer0_kda/top_k"}
  %gte = f32[4]{0} get-tuple-element(%t), index=0
  %ars = f32[4]{0} all-reduce-start(%gte), replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(step)/shard_map/layer0_kda/psum"}
  %ard = f32[4]{0} all-reduce-done(%ars), metadata={op_name="jit(step)/shard_map/layer0_kda/psum"}
  %ffi = f32[4]{0} custom-call(%ard), custom_call_target="jaxk3_all_reduce", metadata={op_name="jit(step)/shard_map/layer1_moe/psum"}
  %b = f32[4]{0} bitcast(%ffi)
  %cp = f32[4]{0} copy(%b), metadata={op_name="jit(step)/shard_map/layer1_moe/copy"}
  %call = f32[4]{0} call(%cp), to_apply=%command_buffer
  %tail = f32[4]{0} fusion(%call), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/add"}
  ROOT %tup = (f32[4]{0}) tuple(%tail)
}
"""


def test_kernel_census_counts_and_attributes_each_kind():
    """Launching ops only (no parameter/constant/get-tuple-element/bitcast/tuple/-done), a `call`
    opened, each kernel in the block its op_name names, an op without a block in the block of its
    first user; a kernel more in a block shows up there and in the total."""
    from jaxk3.tools import census

    blocks = ["embed", "layer0_kda", "layer1_moe", "head"]
    c = census.kernel_census(SYNTHETIC_HLO, blocks)
    assert c["module"] == "jit_step" and c["total"] == 10
    assert c["blocks"] == blocks + [census.UNSCOPED]
    assert c["totals"] == {"embed": 2, "layer0_kda": 3, "layer1_moe": 3, "head": 1, census.UNSCOPED: 1}
    assert c["counts"]["embed"]["loop"] == 2 and c["inherited"] == {"embed": 1}  # %conv, used by embed's %e
    assert c["counts"]["layer0_kda"] == dict.fromkeys(census.KINDS, 0) | {"gemm": 1, "custom": 1, "collective": 1}
    assert c["details"]["layer0_kda"] == {"__cublas$gemm": 1, "custom-fusion:sort": 1, "all-reduce": 1}
    assert c["details"]["layer1_moe"] == {"jaxk3_all_reduce": 1, "copy": 1, "fusion:loop": 1}
    assert c["counts"]["head"]["input"] == 1  # from inside the command buffer
    assert c["kernel_names"]["tail"] == census.UNSCOPED  # op_name names no block, nor do its users/operands
    assert sum(c["totals"].values()) == c["total"] == sum(c["by_kind"].values())
    more = SYNTHETIC_HLO.replace(
        "  %b = f32[4]{0} bitcast(%ffi)",
        '  %b = f32[4]{0} fusion(%ffi), kind=kOutput, calls=%fused_a, metadata={op_name="jit(step)/layer1_moe/x"}')
    m = census.kernel_census(more, blocks)
    assert m["total"] == c["total"] + 1 and m["totals"]["layer1_moe"] == 4 and m["counts"]["layer1_moe"]["output"] == 1
    with pytest.raises(ValueError, match="ENTRY"):
        census.kernel_census("HloModule m\n", blocks)


def test_kernel_census_places_an_unnamed_gemm_by_what_it_multiplies():
    """A GEMM fusion with no op_name (XLA's split-K rewrite drops it) goes to the block of its operand, not of its
    first user (the next block's sum of its partials), while an unnamed non-GEMM kernel keeps its user's block: the
    K3 census put each attention block's o_proj in the MoE block after it (docs/PERF.md, twenty-seventh session)."""
    from jaxk3.tools import census

    hlo = """HloModule jit_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

ENTRY %main (x: f32[4], w: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %w = f32[4]{0} parameter(1), metadata={op_name="weights.layers[0].attn.o_proj"}
  %a = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/layer0_kda/mul"}
  %b = f32[4]{0} bitcast(%a)
  %g = f32[4]{0} fusion(%b, %w), kind=kCustom, calls=%fused_a, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %u = f32[4]{0} fusion(%g), kind=kLoop, calls=%fused_a
  %s = f32[4]{0} fusion(%u), kind=kInput, calls=%fused_a, metadata={op_name="jit(step)/layer0_moe/reduce_sum"}
  ROOT %t = f32[4]{0} fusion(%s), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/head/mul"}
}
"""
    c = census.kernel_census(hlo, ["layer0_kda", "layer0_moe", "head"])
    assert c["details"]["layer0_kda"] == {"fusion:loop": 1, "__triton_nested_gemm_fusion": 1}, c["details"]
    assert c["kernel_names"]["g"] == "layer0_kda" and c["kernel_names"]["u"] == "layer0_moe"
    assert c["inherited"] == {"layer0_kda": 1, "layer0_moe": 1}


def test_profile_parse_degrades_with_a_reason(tmp_path):
    from jaxk3.tools import census

    c = census.kernel_census(SYNTHETIC_HLO, None)
    with pytest.raises(census.ProfileUnavailable, match="no .xplane.pb"):
        census.find_xplane(str(tmp_path))
    bad = tmp_path / "x.xplane.pb"
    bad.write_bytes(b"\x00not a profile")
    with pytest.raises(census.ProfileUnavailable):
        census.profile_times(str(bad), c, 1)
    text = census.census_table(c, None, "t", "no trace (test)")
    assert "profile times unavailable: no trace (test)" in text and "us/step" not in text


def test_census_table_notes_with_and_without_bytes():
    """Profile times whose events ran inside CUDA graphs: the table says so whether or not the blocks' bytes are
    given (a JSON from before the bytes existed re-reports the same); with bytes and a bandwidth it adds MB, the
    bytes' floor and the ratio for each block."""
    from jaxk3.tools import census

    c = census.kernel_census(SYNTHETIC_HLO, ["embed", "layer0_kda", "layer1_moe", "head"])
    times = {"us": {b: 10.0 for b in c["blocks"]}, "events": {b: 1.0 for b in c["blocks"]}, "total_us": 50.0,
             "devices": 1, "source": "test", "unattributed_us": 3.0, "unattributed_events": 2.0,
             "unattributed_ops": ["command_buffer_0"]}
    nbytes = {b: 4_000_000 for b in c["blocks"]}
    for kw in ({}, {"nbytes": nbytes, "bandwidth_GBps": 4000.0}):
        text = census.census_table(c, times, "t", **kw)
        assert "CUDA graphs" in text and "unplaced: 3.0 us/step" in text
        assert ("floor us" in text) == bool(kw)
    text = census.census_table(c, times, "t", nbytes=nbytes, bandwidth_GBps=4000.0)
    assert "|     4.0 |      1.0 | 10.00" in text  # 4 MB at 4000 GB/s: 1 us; 10 us over it


def test_census_decode_tiny_every_layer(tmp_path, capsys):
    """`jaxk3 bench decode --census` on the tiny config (8 layers, TP 2, CPU): every layer's attention
    and ffn block has kernels, the blocks sum to the total, the JSON holds it, and the CPU profile
    sees exactly one thunk event per kernel of each block."""
    from jaxk3.tools import bench_decode as bd
    from jaxk3 import cli

    path = tmp_path / "census.json"
    assert cli.main(["bench", "decode", "--config", "tiny", "--tp", "2", "--batch", "1", "--context", "64",
                     "--strategies", "sharded+one-shot", "--steps", "2", "--census", "--json", str(path),
                     "--copy-mb", "8"]) == 0
    out = capsys.readouterr().out
    res = json.loads(path.read_text())
    assert res["kind"] == "decode_census" and res["platform"] == "cpu" and any("CPU" in n for n in res["notes"])
    (row,) = res["rows"]
    c = row["census"]
    cfg = bd.load_config("tiny")
    names = bd.block_names(cfg)
    assert c["blocks"][:len(names)] == names and set(c["blocks"][len(names):]) <= {"(unscoped)"}
    for g, (attn, ffn) in enumerate(zip(cfg.layer_attn, cfg.layer_ffn)):
        for kind in (attn, ffn):
            b = f"layer{g}_{kind}"
            assert c["totals"][b] > 0, b
            assert c["counts"][b]["collective"] >= 1, (b, c["details"][b])  # the row-parallel sum at TP 2
        assert row["per_layer"]["layers"][str(g)] == c["totals"][f"layer{g}_{attn}"] + c["totals"][f"layer{g}_{ffn}"]
    assert sum(c["totals"].values()) == c["total"]
    assert all(sum(c["counts"][b].values()) == n for b, n in c["totals"].items())
    assert {k: sum(c["counts"][b][k] for b in c["blocks"]) for k in c["kinds"]} == c["by_kind"]
    assert c["details"]["layer3_mla"].get("jaxk3_padded_all_gather") == 1  # the one-shot latent gather
    assert row["profile"] is not None, row["profile_unavailable"]
    assert row["profile"]["events"] == {b: float(n) for b, n in c["totals"].items() if n}
    assert f"kernels per step: {c['total']};" in out and "layer7_moe" in out and "us/step" in out
    assert set(row["bytes"]) == set(names) and all(v > 0 for v in row["bytes"].values())
    assert res["copy_bandwidth_GBps"] > 0 and "floor us" in out and "at the copy bandwidth" in out
    # the GPU timeline: none on the CPU (no device plane), with the reason, in the JSON and the report
    assert row["timeline"] is None and "no GPU plane" in row["timeline_unavailable"]
    assert "GPU timeline unavailable: no GPU plane" in out


def test_busy_idle_unions_overlaps_and_bins_gaps():
    """`census.busy_idle`: overlapping events (a dependent launch starting before its predecessor ends) count once,
    the gaps between the union's pieces fall into their length bins (a gap of exactly 2 us in the 2-10 us bin), all
    per step, the longest listed; no event is a ProfileUnavailable."""
    from jaxk3.tools import census

    ns = [(0, 1000), (500, 3000), (2000, 2500),  # one piece [0, 3000]
          (4000, 5000),  # after a 1 us gap
          (7000, 8000),  # after exactly 2 us
          (13000, 20000),  # after 5 us
          (35000, 36000)]  # after 15 us
    t = census.busy_idle(reversed(ns), steps=2)  # (any order)
    assert t["steps"] == 2 and t["events"] == 3.5
    assert t["span_us"] == 18.0 and t["busy_us"] == (3000 + 1000 + 1000 + 7000 + 1000) / 2e3
    assert abs(t["busy_us"] + t["idle_us"] - t["span_us"]) < 1e-9 and t["busy_fraction"] == 13000 / 36000
    assert t["gaps"] == {"<2us": {"gaps": 0.5, "us": 0.5}, "2-10us": {"gaps": 1.0, "us": 3.5},
                         ">=10us": {"gaps": 0.5, "us": 7.5}}
    assert t["longest_gaps_us"] == [15.0, 5.0, 2.0, 1.0]
    one = census.busy_idle([(10, 20)], steps=1)
    assert one["idle_us"] == 0 and one["busy_fraction"] == 1.0 and one["longest_gaps_us"] == []
    with pytest.raises(census.ProfileUnavailable, match="no device event"):
        census.busy_idle([], steps=1)
    line = census.timeline_line(dict(t, devices=[dict(t, device="/device:GPU:0")], command_buffers="off"))
    assert "busy 6.5 us" in line and "idle 11.5 us" in line and "command buffers off" in line and "[15.0" in line
    assert census.timeline_line(None, "why") == "GPU timeline unavailable: why"


def test_command_buffers_read_from_xla_flags(monkeypatch):
    from jaxk3.tools import bench_decode as bd

    for flags, want in (("", "on (XLA's default)"), ("--xla_gpu_enable_command_buffer=", "off"),
                        ("--foo=1 --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL", "on (FUSION,CUSTOM_CALL)"),
                        ("--xla_gpu_enable_command_buffer=FUSION --xla_gpu_enable_command_buffer=", "off")):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert bd.command_buffers() == want, flags


def test_block_bytes_sum_to_the_step_floor():
    """The census's bytes per block add up to what `bench decode`'s floor counts (weights by group + caches) at the
    tiny config, TP 2, B 1 and 4 (the experts touched grow), and a longer context grows the MLA blocks only."""
    from jax.sharding import Mesh

    from jaxk3.sharding import TP
    from jaxk3.tools import bench_decode as bd

    cfg = bd.load_config("tiny")
    mesh = Mesh(np.asarray(jax.devices()[:2]), (TP,))
    w = bd.random_weights(cfg, mesh, "bfloat16", shard_latent=True)
    for batch in (1, 4):
        cache = bd.random_cache(cfg, mesh, "bfloat16", batch, 64)
        got = bd.block_bytes(cfg, w, cache, batch)
        assert set(got) == set(bd.block_names(cfg))
        want = sum(bd.weight_bytes_per_rank(cfg, w, batch).values()) + bd.cache_bytes_per_rank(cfg, cache)
        assert sum(got.values()) == want, (batch, sum(got.values()), want)
    # a longer context: only the MLA blocks grow, each by its layer's latent cache growth
    longer = bd.block_bytes(cfg, w, bd.random_cache(cfg, mesh, "bfloat16", 4, 128), 4)
    grew = {b for b in got if longer[b] != got[b]}
    assert grew == {b for b in got if b.endswith("_mla")} and grew


def test_kda_cache_bytes_with_the_ring(monkeypatch):
    """A KDA layer's cache bytes a step moves: the state read and written, the conv window read and written whole
    in the shift form (K-1 slots), and in the ring (kda_decode.RING, K slots) K-1 read and one written: its size
    once.  The random cache lays the ring out when the flag is set."""
    from jax.sharding import Mesh

    from jaxk3.kernels import kda_decode
    from jaxk3.layers.kda import KDACache
    from jaxk3.params import shard_bytes
    from jaxk3.sharding import TP
    from jaxk3.tools import bench_decode as bd

    cfg = bd.load_config("tiny")
    mesh = Mesh(np.asarray(jax.devices()[:2]), (TP,))
    K = cfg.short_conv_kernel_size
    for ring in (False, True):
        monkeypatch.setattr(kda_decode, "RING", ring)
        c = next(x for x in bd.random_cache(cfg, mesh, "bfloat16", 2, 64).layers if isinstance(x, KDACache))
        assert c.conv.shape[-1] == (K if ring else K - 1)
        conv, state = shard_bytes(c.conv), shard_bytes(c.state)
        assert bd.layer_cache_bytes(cfg, c) == 2 * state + (conv if ring else 2 * conv)


def test_random_ring_cache_holds_the_shift_forms_window(monkeypatch):
    """The bench's random caches in both conv layouts hold the same values: the ring read at the rows' position
    (`ring_window`) is the shift form's window bitwise, and the states and latents are equal, so a step A/B of
    `kda_decode.RING` compares tokens as well as time.  Context 67: the position is not a multiple of K."""
    from jax.sharding import Mesh

    from jaxk3.kernels import kda_decode
    from jaxk3.layers.kda import KDACache
    from jaxk3.sharding import TP
    from jaxk3.tools import bench_decode as bd

    cfg = bd.load_config("tiny")
    mesh = Mesh(np.asarray(jax.devices()[:2]), (TP,))
    caches = {}
    for ring in (False, True):
        monkeypatch.setattr(kda_decode, "RING", ring)
        caches[ring] = bd.random_cache(cfg, mesh, "bfloat16", 3, 67)
    n = 0
    for a, b in zip(caches[False].layers, caches[True].layers):
        if isinstance(a, KDACache):
            n += 1
            assert b.conv.shape[-1] == a.conv.shape[-1] + 1
            win = kda_decode.ring_window(b.conv, caches[True].length)
            np.testing.assert_array_equal(np.asarray(win.astype(jnp.float32)), np.asarray(a.conv.astype(jnp.float32)))
            assert np.asarray(a.conv.astype(jnp.float32)).std() > 0.05  # random, not zeros
            np.testing.assert_array_equal(np.asarray(b.state), np.asarray(a.state))
        else:
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert n == len(cfg.kda_layers)


def test_top2_margin():
    from jaxk3.tools.bench_decode import top2_margin

    lg = np.array([[0.0, 3.0, 1.0, -4.0], [2.0, 2.5, 2.4, 0.0]], np.float32)
    assert top2_margin(lg) == pytest.approx((2.5 - 2.4) / 4.0, rel=1e-5)  # the closer row, over max|logit|
    assert top2_margin(np.array([[1.0, 1.0, 0.5]], np.float32)) == 0.0


def test_census_more_layers_more_kernels():
    """Layers 3-5 vs 3-4 of the tiny config (no AttnRes block starts at 5, so nothing else changes):
    the extra layer adds exactly its own blocks' kernels, and every shared block counts the same."""
    from jaxk3.tools import bench_decode as bd

    stock = tuple(s for s in bd.STRATEGIES if s[0] == "stock")
    got = {l: bd.census_decode(config="tiny", layers=l, experts=None, tp=2, batches=(1,), contexts=(64,),
                               strategies=stock, profile=False)["rows"][0]  # (no profile: no copy bandwidth)
           for l in ("3-4", "3-5")}
    a, b = got["3-4"]["census"], got["3-5"]["census"]
    assert got["3-4"]["profile"] is None and got["3-4"]["profile_unavailable"]
    assert b["blocks"] == a["blocks"][:-2] + ["layer5_kda", "layer5_moe"] + a["blocks"][-2:]
    assert all(a["counts"][blk] == b["counts"][blk] for blk in a["blocks"])
    added = b["totals"]["layer5_kda"] + b["totals"]["layer5_moe"]
    assert added > 0 and b["total"] - a["total"] == added
    assert got["3-5"]["per_layer"]["layers"][5] == added


def test_census_misuse():
    from jaxk3 import cli

    with pytest.raises(SystemExit):
        cli.parse_args(["bench", "decode", "--config", "tiny", "--census", "--plot", "x.png"])
    assert cli.parse_args(["bench", "decode", "--config", "kimi-linear-48b", "--census"]).census


def test_bench_decode_kernel_modes(tmp_path, capsys):
    """--kernels runs each strategy under each mode in one process (names carry the mode); a mode the
    platform cannot serve ("on" on the CPU) is exit 2 with the kernel named, not a traceback."""
    from jaxk3.tools import bench_decode as bd
    from jaxk3 import cli

    s = bd.with_kernels((bd.STRATEGIES[0], bd.STRATEGIES[3]), ("off", "auto"))
    assert [x.name for x in s] == ["stock[kernels=off]", "stock[kernels=auto]", "packed+sharded+one-shot[kernels=off]",
                                   "packed+sharded+one-shot[kernels=auto]"]
    assert bd.with_kernels(bd.STRATEGIES, ("auto",)) == bd.STRATEGIES
    base = ["bench", "decode", "--config", "tiny", "--layers", "6-7", "--tp", "2", "--batch", "1", "--context", "64",
            "--steps", "1", "--repeats", "1", "--copy-mb", "1", "--strategies", "stock"]
    out = tmp_path / "d.json"
    assert cli.main(base + ["--kernels", "off", "--json", str(out), "--hlo-dir", str(tmp_path / "hlo")]) == 0
    assert {r["strategy"] for r in json.loads(out.read_text())["rows"]} == {"stock[kernels=off]"}
    (hlo,) = (tmp_path / "hlo").iterdir()  # the compiled step's HLO, named after the strategy
    assert hlo.name == "decode_stock_kernels_off__B1_S64.hlo.txt" and "HloModule" in hlo.read_text()
    # a variant's name holds a slash ("stock[serving/auto]"): the file stays in the directory
    assert bd._file_part("stock[serving/auto]") == "stock_serving_auto_"
    capsys.readouterr()
    assert cli.main(base + ["--kernels", "on"]) == 2
    err = capsys.readouterr().err
    assert "kernels='on' but" in err and "platform 'cpu'" in err


def test_prefill_work_counts_the_active_weights_and_the_causal_pairs():
    """`bench generate`'s TTFT floor: Kimi-Linear-48B-A3B multiplies ~3 B active parameters a token (the
    hub's name says A3B: 2.73 B here without the embedding lookup, plus the 0.38 B head once per row),
    so a 4K prompt is ~24 TFLOP (issue 23: 2 x 3 B x 4096 ~ 25); the chunking moves no FLOP (causal
    pairs sum to T(T+1)/2 in any chunking) and the head counts once per row, in the last chunk."""
    from jaxk3.tools import bench_decode as bd
    from jaxk3.tools import bench_generate as bg

    cfg = bd.load_config("kimi-linear-48b")
    tok, head = bg.matmul_elements(cfg)
    assert 2.6e9 < tok < 2.9e9 and 0.3e9 < head < 0.45e9
    one = bg.prefill_work(cfg, 2, 4096, 4096)
    eight = bg.prefill_work(cfg, 2, 4096, 512)
    assert len(one) == 1 and len(eight) == 8 and [c["tokens"] for c in eight] == [1024] * 8
    total = sum(c["flops"] for c in eight)
    assert total == pytest.approx(one[0]["flops"], rel=1e-12) and 22e12 < total / 2 < 26e12
    assert eight[-1]["flops"] - eight[-2]["flops"] > 2 * 2 * head * 0.99  # the head, and later positions' pairs
    short = bg.prefill_work(cfg, 1, 700, 512, bytes_of_chunk=lambda n: 10 * n)
    assert [c["tokens"] for c in short] == [512, 188] and [c["bytes"] for c in short] == [5120, 1880]


def test_aot_launches_read_xla_thunk_sequence(tmp_path):
    """aot.launches joins XLA's thunk sequence (each kernel's grid, threads, shared memory) to the HLO names of
    its thunk metadata; launch_summary counts the launches of fewer CTAs than the SMs by block kind and kernel."""
    from jaxk3.tools import aot
    from jaxk3.tools.bench_decode import launch_summary

    (tmp_path / "module_0001.jit_step.thunk_sequence.txt").write_text(
        "001: kCustomKernel [source       | next=002 (1)] loop_add_fusion grid: [18, 1, 1] threads: [128, 1, 1]  "
        "shared_memory: 0 bytes\n"
        "002: kCustomKernel [prev=001 (1) | next=003 (1)] _kernel__1 grid: [1, 32, 4] threads: [128, 1, 1]  "
        "shared_memory: 512 bytes\n"
        "003: kCopy [prev=002 (1)] copy.1\n"
        "004: kCustomKernel [prev=002 (1) | next=005 (1)] _gate_up_kernel grid: [9, 64, 1] threads: [256, 1, 1] "
        "cluster: [1, 1, 1] shared_memory: 1024 bytes\n")
    (tmp_path / "module_0001.jit_step.thunk_metadata.txt").write_text("".join(
        f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n    thunk_id: {i}\n  }}\n'
        f'  thunk_kind: "kCustomKernel"\n}}\n' for i, n in ((1, "loop_add_fusion"), (2, "pallas_call.7"),
                                                         (4, "pallas_call.9"))))
    got = aot.launches(str(tmp_path))
    assert got.pop(2) == {"name": "copy.1", "kind": "kCopy"}  # not a kernel XLA launches: its kind alone
    assert [(x["name"], x["ctas"], x["threads"], x["shared_memory"]) for x in got] == [
        ("loop_add_fusion", 18, 128, 0), ("pallas_call.7", 128, 128, 512), ("pallas_call.9", 576, 256, 1024)]
    assert got[1]["grid"] == [1, 32, 4]
    assert aot.launches(str(tmp_path / "none")) == []
    text = launch_summary([dict(x, block=b) for x, b in zip(got, ("layer1_moe", "layer2_kda", "layer2_kda"))], 132)
    assert "3 kernels" in text and "1024 B" in text and "2 kernels of fewer CTAs than its 132 SMs" in text
    assert "moe:loop_add_fusion(18x128) x1" in text and "kda:_kernel(128x128) x1" in text and "gate_up" not in text
    with open(tmp_path / "module_0001.jit_step.thunk_sequence.txt", "a") as fh:  # a launch it cannot read: named
        fh.write("005: kCustomKernel [prev=004 (1)] _k grid: [2, 1] threads: [1, 1, 1]\n")
    with pytest.raises(ValueError, match="unknown form"):
        aot.launches(str(tmp_path))
