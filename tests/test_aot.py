"""The decode step compiled for an H200 on a machine without one (jaxk3.tools.aot, XLA's deviceless compile).

- Every device kernel, forced on (`kernels="on"`), compiles for the H200 at the presets' real dimensions:
  K3 layers 11-14 at TP 1, 2 and 8 and Kimi-Linear-48B, B = 1 and 8, bf16 and MXFP4 experts. A kernel
  that asks for more shared memory than the H200 has fails its compile here, as on the device (the
  first test shows the check has teeth).
- So do the prefill's kernels (one chunk of `Model.generate`'s prefill: the grouped-GEMM MoE, KDA's chunked
  form, MLA's flash attention).
- The 48B B = 1 step's launches per block stay within their budget (the H200 census's, less what keeping the
  model's bf16 roundings removed: docs/PERF.md).

These run where jax has its CUDA plugin: `make aot-test` (.venv-aot: jax 0.11.2, the device image's, and
jax-cuda13-plugin; no GPU or driver needed). Elsewhere every test skips, saying so.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os

import pytest

from jaxk3.tools import aot

aot.prepare()  # before jax starts its backends (this file runs in a process of its own under `make aot-test`)


def _has_cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


if not _has_cuda_plugin():
    if os.environ.get("JAXK3_AOT_REQUIRED"):  # `make aot-test`: a .venv-aot without the plugin is a failure
        raise RuntimeError("JAXK3_AOT_REQUIRED is set and this jax has no CUDA plugin (jax-cuda13-plugin)")
    pytest.skip("the deviceless compile needs jax's CUDA plugin (jax-cuda13-plugin): `make aot-test` runs these "
                "in .venv-aot", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxk3.tools import bench_decode as bd  # noqa: E402


@pytest.fixture(scope="module")
def h200():
    try:
        return aot.target_mesh("h200", 1)
    except aot.TargetUnavailable as e:  # the plugin is installed but did not register (backends started first)
        pytest.fail(str(e))


def test_a_kernel_too_large_for_the_h200_fails_its_compile(h200):
    """A Pallas kernel whose block needs 256 KiB of shared memory (the H200 allows a block 227 KiB) does not
    compile for the H200, and the same kernel at 64 KiB does: the check the tests below rely on."""
    from jax.experimental import pallas as pl

    from jaxk3._compat import call_shard_map

    def compiled(n: int):
        def kernel(a_ref, b_ref, o_ref):
            o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

        def f(a, b):
            return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n, n), jnp.float32))(a, b)

        g = call_shard_map(f, mesh=h200, in_specs=(P(), P()), out_specs=P(), check_vma=False)
        a = jax.ShapeDtypeStruct((n, n), jnp.float32, sharding=NamedSharding(h200, P()))
        return jax.jit(g).lower(a, a).compile()

    assert "__gpu$xla.gpu.triton" in compiled(128).as_text()
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        compiled(256)


@contextlib.contextmanager
def _device_kernels():
    """The names of the kernels whose device path is traced inside the block (every registry entry's `device`
    wrapped to record its name; jax's caches cleared first, so that nothing is reused untraced)."""
    from jaxk3.kernels import registry

    seen: set[str] = set()
    saved = dict(registry.REGISTRY)

    def recording(k):
        def device(*a, **kw):
            seen.add(k.name)
            return k.device(*a, **kw)
        return dataclasses.replace(k, device=device)

    jax.clear_caches()
    registry.REGISTRY.update({n: recording(k) for n, k in saved.items()})
    try:
        yield seen
    finally:
        registry.REGISTRY.clear()
        registry.REGISTRY.update(saved)


def _census(config: str, tp: int, batches, contexts, strategies, kernels: str, layers: str | None = None) -> dict:
    """The census of `config`'s step compiled for `tp` H200s: K3's layers 11-14 (32 experts kept), else `layers`
    of the 48B (None: all 27; 64 experts kept)."""
    k3 = config == "k3"
    names = set(strategies)
    chosen = bd.with_kernels(tuple(s for s in bd.STRATEGIES if s.name in names), (kernels,))
    return bd.census_decode(config=config, layers="11-14" if k3 else layers, experts=32 if k3 else 64, tp=tp,
                            batches=batches, contexts=contexts, strategies=chosen, target="h200")


def _triton_calls(row: dict) -> int:
    """The step's Pallas (Triton) kernels: custom calls to XLA's Triton target, over every block."""
    return sum(n for d in row["census"]["details"].values() for t, n in d.items() if "gpu.triton" in t)


def _abstract_step(config: str, layers: str, experts: int, strategy: str, **compile_options):
    """One decode step (B = 1, 4K context) of `config`'s `layers` with `strategy`, lowered on abstract weights and
    cache for one H200 and compiled (`compile_options`: XLA's, e.g. `aot.dump_options`)."""
    s = next(x for x in bd.STRATEGIES if x.name == strategy)
    _, first, _, cfg, mesh, _ = bd._setup(config, layers, experts, 1, (1,), (s,), "h200")
    made = bd.AbstractWeights(cfg, mesh, "bfloat16")
    _, _, w, step, cache, ids, valid = bd._case(cfg, made, mesh, "bfloat16", first, 1, 4096, s, lambda g: None)
    return step.lower(w, cache, ids, valid).compile(compiler_options=compile_options or None)


BOTH = ("stock", "packed+sharded+one-shot")
FIT_CASES = [("k3", 1, (4096, 32768), BOTH), ("k3", 2, (4096,), BOTH), ("k3", 8, (4096,), BOTH),
             ("kimi-linear-48b", 1, (4096, 32768), ("stock",)),
             ("kimi-linear-48b", 1, (4096,), ("packed+sharded+one-shot",))]


# `slow`: CI's aot stage leaves these out (.ci/run: `-m 'not slow'`, its 40 minutes); `make aot-test` runs them. Each
# is a per-rank shape between two that CI compiles (K3 TP 2 between TP 1 and TP 8; the 48B prefill's 8 rows of 1024
# tokens beside its one row of 4096; K3's TP 8 prefill beside its TP 1), or a census comparison of switches already on.
CI_LEAVES_OUT = {("k3", 2), ("kimi-linear-48b", 1, 8, 1024), ("k3", 8, 1, 2048)}


def _cases(cases, ids, key):
    return [pytest.param(*c, id=i, marks=[pytest.mark.slow] if key(c) in CI_LEAVES_OUT else [])
            for c, i in zip(cases, ids)]


@pytest.mark.parametrize("config,tp,contexts,strategies", _cases(
    FIT_CASES, [f"{c}-tp{t}-{'+'.join(str(x // 1024) + 'k' for x in ctx)}-{'+'.join(s)}" for c, t, ctx, s in FIT_CASES],
    lambda c: c[:2]))
def test_every_kernel_compiles_for_the_h200_at_real_dims(config, tp, contexts, strategies):
    """`kernels="on"` at the preset's real dimensions compiles for the H200 in every case (no kernel asks for
    more than the device has), and the blocks' kernels are in it: each block's decode kernel was traced on its
    device path, and the compiled step holds Pallas calls (XLA emits none of its own under this target: with
    the kernels off the step has none)."""
    # the 48B's layers 0-3 hold each of its kinds of block (KDA + dense MLP, KDA + MoE, MLA + MoE) at its real
    # dims; its other 23 layers repeat them (the whole step's compile is test_48b_step_launches_within_the_budget's)
    with _device_kernels() as seen:
        on = _census(config, tp, (1, 8), contexts, strategies, "on", layers="0-3")
    assert len(on["rows"]) == 2 * len(contexts) * len(strategies)
    for r in on["rows"]:
        case = f"{config} TP {tp} B={r['batch']} S={r['context']} {r['strategy']}"
        assert r["profile_unavailable"] == "compiled for h200, not run", case
        assert _triton_calls(r) > 0, case
    blocks = ({"kda_decode", "kda_decode_in"}, {"mla_decode", "mla_decode_uv"}, {"moe_experts", "moe_experts_routed"})
    for block in blocks:
        assert seen & block, (block, sorted(seen))


def _prefill_triton_calls(config: str, tp: int, batch: int, tokens: int, kernels: str = "on") -> int:
    """The prefill of one chunk (`generation.build_prefill`, as `Model.generate` runs it) compiled for `tp` H200s
    with abstract weights and a cache of 8192 positions: its Pallas (Triton) kernels."""
    from jaxk3 import generation
    from jaxk3.model import StepOptions

    k3 = config == "k3"
    s = bd.Strategy("stock", False, "lax", kernels=kernels)
    # Kimi-Linear's layers 0-3 hold every kind of its layer (KDA + dense MLP, KDA + MoE, MLA + MoE), all 256 experts
    _, first, _, cfg, mesh, _ = bd._setup(config, "11-14" if k3 else "0-3", 32 if k3 else 256, tp, (batch,), (s,),
                                          "h200")
    made = bd.AbstractWeights(cfg, mesh, "bfloat16")
    fn = generation.build_prefill(made.config(s), StepOptions(gather="lax", shard_latent=False, layer_offset=first,
                                                              kernels=kernels, serving=True), mesh, False, None)
    rows = NamedSharding(mesh, P())
    text = fn.lower(made.step_weights(s), bd.abstract_cache(cfg, mesh, "bfloat16", batch, 8192),
                    jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=rows),
                    jax.ShapeDtypeStruct((batch, tokens), jnp.bool_, sharding=rows), jnp.int32(0)).compile().as_text()
    return bd.hlo_census(text)["custom_call_targets"].get("__gpu$xla.gpu.triton", 0)


PREFILL_CASES = [("kimi-linear-48b", 1, 1, 4096), ("kimi-linear-48b", 1, 8, 1024), ("k3", 1, 1, 2048),
                 ("k3", 8, 1, 2048)]


@pytest.mark.parametrize("config,tp,batch,tokens", _cases(PREFILL_CASES, [f"{c}-tp{t}-B{b}-T{n}" for c, t, b, n in
                                                                           PREFILL_CASES], tuple))
def test_every_prefill_kernel_compiles_for_the_h200_at_real_dims(config, tp, batch, tokens):
    """The prefill's kernels (the grouped-GEMM MoE, KDA's chunked form, MLA's flash attention) forced on compile for
    the H200 at the presets' dimensions, and are there: traced on their device paths, Pallas calls compiled."""
    with _device_kernels() as seen:
        assert _prefill_triton_calls(config, tp, batch, tokens) > 0
    assert {"moe_grouped", "kda_prefill", "mla_prefill"} <= seen, sorted(seen)


# Launches per block of the 48B B = 1 step (`auto`, the serving layout). The H200's census counted 281 (docs/PERF.md,
# nineteenth session), as this compile does with XLA's default precision; with the model's own roundings
# (model.EXCESS_PRECISION False, twenty-first session) each MoE block after a KDA block takes 6, 262 in all; with the
# residual add in the experts' kernel 2 (moe_experts.RESIDUAL_IN_DOWN, thirty-fifth session) 5, 237 in all. Layer 0's
# KDA block also holds the step's length update and the valid flags' conversion that the KDA and MLA kernels read (4
# there). A change that adds a launch to a block fails here first.
LAUNCH_BUDGET_48B_B1 = {"embed": 1, "kda": 3, "mla": 5, "mlp": 5, "moe": 5, "head": 5, "layer0_kda": 4}
LAUNCH_OPS_48B_B1 = 237  # (262 before moe_experts.RESIDUAL_IN_DOWN: the residual add of 25 MoE blocks in kernel 2)
MOE_AFTER_KDA = 5


@functools.lru_cache(maxsize=1)
def _census_48b_b1() -> dict:
    """The 48B B = 1 step's census row at main's switches (two tests read it: one compile)."""
    (row,) = _census("kimi-linear-48b", 1, (1,), (4096,), ("stock",), "auto")["rows"]
    return row


def test_48b_step_launches_within_the_measured_budget():
    row = _census_48b_b1()
    assert row["launch_ops"] <= LAUNCH_OPS_48B_B1, row["launch_ops"]
    # the thunk sequence read back (aot.launches): one kernel launch per launch op here (no copies or FFI calls)
    assert len(row["launches"]) == row["launch_ops"] and all("ctas" in x for x in row["launches"])
    over = {}
    for block, n in row["census"]["totals"].items():
        kind = block if block in LAUNCH_BUDGET_48B_B1 or not block.startswith("layer") else block.rsplit("_", 1)[-1]
        if n > LAUNCH_BUDGET_48B_B1[kind]:
            over[block] = n
    assert not over, f"blocks over their launch budget {LAUNCH_BUDGET_48B_B1}: {over}"
    kda = [n for b, n in row["census"]["totals"].items() if b.endswith("_kda") and b != "layer0_kda"]
    assert len(kda) == 19 and set(kda) == {3}, kda  # every later KDA block: norm+projections, the step, o_proj
    after_kda = [row["census"]["totals"][f"layer{l}_moe"] for l in range(1, 27)
                 if f"layer{l}_kda" in row["census"]["totals"]]
    assert len(after_kda) == 19 and set(after_kda) == {MOE_AFTER_KDA}, after_kda
    # each Pallas kernel named for what it does (`pallas_call(name=...)`), as a profile or Nsight Compute lists them:
    # a later KDA block's three, an MLA block's attention and its prep
    kernels = {}
    for x in row["launches"]:
        kernels.setdefault(x["block"], []).append(bd.kernel_name(x))
    assert kernels["layer1_kda"] == ["gemv_norm", "kda_step_in", "gemv_gnorm"], kernels["layer1_kda"]
    assert {"mla_prep", "mla_attention", "mla_merge_uv"} <= set(kernels["layer3_mla"]), kernels["layer3_mla"]
    assert {"moe_gate_up", "moe_down"} <= set(kernels["layer1_moe"]), kernels["layer1_moe"]
    # no Pallas kernel left under its Python function's name (`_kernel`, `_gate_up_kernel`: two modules' kernels
    # would read alike in a profile)
    unnamed = sorted({n for ns in kernels.values() for n in ns if n.startswith("_")})
    assert not unnamed, unnamed


@pytest.mark.slow  # a second 48B compile, the switch turned over; the budget test above pins main's 237 (CI_LEAVES_OUT)
def test_48b_step_with_the_residual_added_in_the_experts_kernel(monkeypatch):
    """moe_experts.RESIDUAL_IN_DOWN (kernel 2 writing the new stream bf16(h + out) itself) compiled for the H200 over the
    48B's 27 layers at B = 1: every MoE block but the last one's (whose add the head's fusions take) loses XLA's
    residual-add fusion, 25 launches (262 -> 237, under issue 22's 250), and its kernel 2 still compiles (576
    programs of 4 rows: `_fold_config`); no block gains one."""
    from jaxk3.kernels import moe_experts as ME

    def counts(row: dict) -> tuple[int, dict]:
        return row["launch_ops"], row["census"]["totals"]

    main = ME.RESIDUAL_IN_DOWN
    base = _census_48b_b1()  # main's switch (the budget test's compile), before the switch is turned over
    with monkeypatch.context() as m:
        m.setattr(ME, "RESIDUAL_IN_DOWN", not main)
        (other,) = _census("kimi-linear-48b", 1, (1,), (4096,), ("stock",), "auto")["rows"]
    (n_off, t_off), (n_on, t_on) = (counts(other), counts(base)) if main else (counts(base), counts(other))
    moe = [b for b in t_on if b.endswith("_moe")]
    assert n_off - n_on == len(moe) - 1 == 25, (n_off, n_on, len(moe))
    assert {b: t_off[b] - t_on[b] for b in moe} == {b: int(b != "layer26_moe") for b in moe}
    assert all(t_on[b] == t_off[b] for b in t_on if b not in moe), (t_off, t_on)


@pytest.mark.slow  # three K3 compiles comparing two switches that are on by default (CI_LEAVES_OUT's note)
def test_k3_step_with_the_attn_res_stack_by_selects_and_the_latent_norm_in_up(monkeypatch):
    """attn_res_norm.SELECT_STACK and moe.LATENT_NORM_IN_UP, on by default since an H100 A/B timed them faster at B = 1
    (docs/PERF.md, twenty-ninth session): compiled for the H200, K3 layers 11-14 packed at B = 1 takes 162 launches as
    this compile counts them, against 191 with both switches off (the latent norm alone 186: its two kernels go into
    the up projection's GEMV, and with the selects XLA fuses more around it); no block takes more launches than with
    both off."""
    from jaxk3.kernels import attn_res_norm
    from jaxk3.layers import moe

    def totals() -> tuple[int, dict]:
        (row,) = _census("k3", 1, (1,), (4096,), ("packed+sharded+one-shot",), "auto")["rows"]
        return row["launch_ops"], row["census"]["totals"]

    assert attn_res_norm.SELECT_STACK and moe.LATENT_NORM_IN_UP
    n_on, t_on = totals()
    monkeypatch.setattr(attn_res_norm, "SELECT_STACK", False)
    n_latent, t_latent = totals()
    monkeypatch.setattr(moe, "LATENT_NORM_IN_UP", False)
    n_off, t_off = totals()
    assert n_on <= n_off - 29, (n_off, n_latent, n_on)
    assert n_latent <= n_off - 5, (n_off, n_latent)
    assert all(t_latent[b] < t_off[b] for b in t_off if b.endswith("_moe")), (t_off, t_latent)
    assert all(t_on.get(b, 0) <= n for b, n in t_off.items()), (t_off, t_on)


def test_the_step_keeps_its_bf16_roundings_on_the_h200(monkeypatch):
    """model.EXCESS_PRECISION False (the default): the residual stream is rounded to bf16 after each block on the
    H200 as written (and as on the CPU), not carried in float32 by XLA's excess precision. Read in the compiled
    48B layers 0-3 step: every fusion that adds a block's partial sums (f32[4, 1, 2304]) to the stream rounds
    through bf16; with XLA's default precision some do not."""
    import re

    from jaxk3 import model

    def fusions(excess: bool) -> list[str]:
        monkeypatch.setattr(model, "EXCESS_PRECISION", excess)
        text = _abstract_step("kimi-linear-48b", "0-3", 64, "stock").as_text()
        bodies = re.findall(r"\n(%fused_[\w.]* \([^\n]*\{\n.*?\n\})", text, re.S)
        return [b for b in bodies if "f32[4,1,2304]" in b.split("\n")[0]]

    def rounds(body: str) -> bool:  # f32 -> bf16 -> f32 on a row inside the fusion
        return bool(re.search(r"bf16\[1,2304\]\{1,0\} convert\(", body)) and body.count("convert(") >= 2

    exact, loose = fusions(False), fusions(True)
    assert exact and all(rounds(b) for b in exact), [b.split("\n")[0] for b in exact if not rounds(b)]
    assert not all(rounds(b) for b in loose)


def test_the_cuda_kernels_run_inside_the_steps_command_buffer(monkeypatch, tmp_path):
    """The K3 layers 11-14 packed B = 1 step, compiled for the H200 with the MXFP4 CUDA kernels (the jaxk3 FFI
    targets, command-buffer compatible): XLA's thunk passes put the whole step, those custom calls included, in one
    command buffer, as on the device. The target's driver version (aot.H200's `driver_version`) is what lets them in:
    described without one, XLA takes the driver for 0.0.0, drops custom calls from its command buffers, and the step
    splits into a command buffer between each two calls."""
    import glob
    import re

    from jaxk3.kernels import mxfp4_cuda as CU

    if (why := CU._register(CU.TARGET)) is not None:  # the extension's build (the traced platform is the H200's)
        pytest.skip(f"the MXFP4 CUDA kernels are not in this build: {why} (`make aot` builds them)")

    def structure(target_config: str, d) -> tuple[int, int, int]:
        monkeypatch.setitem(aot.TARGETS, "h200", target_config)
        _abstract_step("k3", "11-14", 32, "packed+sharded+one-shot", **aot.dump_options(str(d)))
        (seq,) = glob.glob(str(d / "*jit_step*thunk_sequence_after_thunk_passes.txt"))
        text = open(seq).read()
        top = re.findall(r"^\d+: (k\w+)", text, re.M)  # top-level thunks (a command buffer's own are indented)
        inner = re.findall(r"^ +\d+: kCustomCall", text, re.M)
        return top.count("kCommandBuffer"), top.count("kCustomCall"), len(inner)

    buffers, outside, inside = structure(aot.H200, tmp_path / "driver")
    assert (buffers, outside) == (1, 0) and inside >= 4, (buffers, outside, inside)  # 4 layers' kernel 1
    no_driver = aot.H200.replace('  driver_version: "13.0.0"\n', "")
    assert no_driver != aot.H200
    buffers, outside, inside = structure(no_driver, tmp_path / "none")
    assert buffers > 1 and outside >= 4 and inside == 0, (buffers, outside, inside)
