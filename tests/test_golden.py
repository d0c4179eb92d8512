"""Golden values: the decode step gives the same tokens and bitwise-equal logits as the code had
before the foundation redesign (issue 11), on fixed random tiny K3 and Kimi-Linear models at
TP 1/2/4/8 on CPU.

The weights come from this file's own generator (`golden_weights`: one NumPy generator per
checkpoint name, so the values do not depend on any init code of the package), are loaded by
their checkpoint names through `Model.from_weights`, and are decoded with the token-by-token step
(`Model.step`, a fixed 64-slot cache, left-padded ragged prompts, greedy).  The golden tokens and
the SHA-256 of the float32 logits were produced by the code of commit 3e9e625 (before the
redesign) with this file's generator and `_decode`.

Bitwise equality is version-specific: XLA's CPU code generation may round differently in another
jax release, so the digests are kept per jax version, and a jax version without digests checks
the tokens only (and says so).  It is also CPU-specific: XLA marks reduction adds reassociable and
LLVM vectorises them for the host's vector units, so the same program sums in another order on
another CPU family (seen 2026-12-01: on an AVX-512/AMX Xeon, 7 of the 8 digests differ from the
recording machine's, while the code of 8a58ddd, before that day's changes, and the code after them
give the same bits there; seen again 2026-12-03 on an AVX-512 Xeon without AMX, where the K3 digests
differ once more and the code of 491c058 gives the same bits as the day's last commit).  So each case
keeps one digest per CPU family seen, each recorded with known-good code; the tokens are checked on
every machine.  The tokens must agree on every version: the tiny models' greedy
top-2 gaps are far above one bf16 rounding.
"""
from __future__ import annotations

import hashlib
import zlib

import jax
import numpy as np
import pytest

import jaxk3
from jaxk3.config import KimiK3Config

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 5]]
NEW = 4
CACHE = 64

# tokens: the same on every jax version; sha256: of the [2, NEW, vocab] float32 logits, per jax version
GOLDEN_TOKENS = {
    "k3": [[458, 971, 975, 639], [20, 859, 287, 499]],
    "kl": [[458, 816, 375, 382], [20, 955, 677, 874]],
}
# per case: the first machine's digest, an AVX-512/AMX Xeon's (2026-12-01), and where they differ an AVX-512 Xeon's
# without AMX (2026-12-03; recorded with the code of 491c058, which passed CI on the AMX machine, and of the day's
# last commit: the same bits on both jax versions), and on jax 0.10.2 an AMD EPYC's with AVX2 and no AVX-512 (2026-12-06;
# recorded with the code of 485c8f2, which passed CI on its machine, and of the day's last commit: the same bits)
GOLDEN_SHA256: dict[str, dict[str, tuple[str, ...]]] = {
    "0.10.2": {
        "k3/tp1": ("ba8160240db72bffb0913b0404819b3f803fbbb7fd46a9d27cb386ba4d1d0bac",
                   "be4c33ca31501c5349cb33ea1979f032da0ac2f4583e561a004c1ec319949881"),
        "k3/tp2": ("04c1b80a25b813629034376a1498526f43deb460119863825147f32d8c41a494",
                   "be4c33ca31501c5349cb33ea1979f032da0ac2f4583e561a004c1ec319949881",
                   "ba8160240db72bffb0913b0404819b3f803fbbb7fd46a9d27cb386ba4d1d0bac"),
        "k3/tp4": ("fcd612852149c363d87ec4ab59417a659549cdac6dac33e7adc110f6b9dc22d8",
                   "be4c33ca31501c5349cb33ea1979f032da0ac2f4583e561a004c1ec319949881",
                   "ba8160240db72bffb0913b0404819b3f803fbbb7fd46a9d27cb386ba4d1d0bac"),
        "k3/tp8": ("04c1b80a25b813629034376a1498526f43deb460119863825147f32d8c41a494",
                   "ac000ca8fbe0ccbec62842098d4e6e8230efdc816b49453a6f0256acc8525f2c",
                   "eaaebee12b56d4b44044b3483b5a3def88dc1cf08713e8431f6483d111385b9a",
                   "0109522e64706bbc58b84f847d03b5636dc8827493298e560681111f384dc7ac"),
        "kl/tp1": ("93d5bc0cf60a8bed583d8455ce59e240cb38d62aaeab6e736bf689eb38b027d2",
                   "0b1c59079f0f00126c52566e25b163c99f2878146c172f4d18639227140cca5d"),
        "kl/tp2": ("93d5bc0cf60a8bed583d8455ce59e240cb38d62aaeab6e736bf689eb38b027d2",
                   "0b1c59079f0f00126c52566e25b163c99f2878146c172f4d18639227140cca5d"),
        "kl/tp4": ("0b1c59079f0f00126c52566e25b163c99f2878146c172f4d18639227140cca5d",
                   "0b1c59079f0f00126c52566e25b163c99f2878146c172f4d18639227140cca5d"),
        "kl/tp8": ("0b1c59079f0f00126c52566e25b163c99f2878146c172f4d18639227140cca5d",
                   "9ecadd3954351b2b3f0456652c175443f4e8dde382c2effb69b833a4875259d4"),
    },
    "0.12.0.1": {
        "k3/tp1": ("04c1b80a25b813629034376a1498526f43deb460119863825147f32d8c41a494",
                   "5ea19cc1f4e8ddee5da233b0d306ae0dad98d495856dd16e0b54d3903d0d0dff",
                   "be4c33ca31501c5349cb33ea1979f032da0ac2f4583e561a004c1ec319949881"),
        "k3/tp2": ("04c1b80a25b813629034376a1498526f43deb460119863825147f32d8c41a494",
                   "5ea19cc1f4e8ddee5da233b0d306ae0dad98d495856dd16e0b54d3903d0d0dff",
                   "be4c33ca31501c5349cb33ea1979f032da0ac2f4583e561a004c1ec319949881"),
        "k3/tp4": ("04c1b80a25b813629034376a1498526f43deb460119863825147f32d8c41a494",
                   "ab683937cbd175a6e8d53cb2fed4db43ee5abfca1279e43f5b076ff3c1b5aad6",
                   "be4c33ca31501c5349cb33ea1979f032da0ac2f4583e561a004c1ec319949881"),
        "k3/tp8": ("64cac54a0e7323bfc57b2117dee94fcdfd8f0051d826c226cacb25a1adace8ae",
                   "ab683937cbd175a6e8d53cb2fed4db43ee5abfca1279e43f5b076ff3c1b5aad6",
                   "eaaebee12b56d4b44044b3483b5a3def88dc1cf08713e8431f6483d111385b9a"),
        "kl/tp1": ("93d5bc0cf60a8bed583d8455ce59e240cb38d62aaeab6e736bf689eb38b027d2",
                   "cda0e946da14ea279c2ae00fe9e7bdfa23fce40e829e65fe828b4a931c32e971"),
        "kl/tp2": ("93d5bc0cf60a8bed583d8455ce59e240cb38d62aaeab6e736bf689eb38b027d2",
                   "cda0e946da14ea279c2ae00fe9e7bdfa23fce40e829e65fe828b4a931c32e971"),
        "kl/tp4": ("0b1c59079f0f00126c52566e25b163c99f2878146c172f4d18639227140cca5d",
                   "cda0e946da14ea279c2ae00fe9e7bdfa23fce40e829e65fe828b4a931c32e971"),
        "kl/tp8": ("0b1c59079f0f00126c52566e25b163c99f2878146c172f4d18639227140cca5d",
                   "cda0e946da14ea279c2ae00fe9e7bdfa23fce40e829e65fe828b4a931c32e971"),
    },
}


def _init_kind(name: str) -> tuple[str, float, float]:
    """(distribution, scale, shift) of a checkpoint tensor, from its name."""
    if name.endswith("A_log"):
        return "log_uniform", 1.0, 16.0
    if name.endswith("norm.weight"):
        return "normal", 0.1, 1.0
    if name.endswith("dt_bias") or name == "model.embed_tokens.weight":
        return "normal", 1.0, 0.0
    if name.endswith("e_score_correction_bias") or name.endswith("res_proj.weight"):
        return "normal", 0.1, 0.0
    if name.endswith("conv1d.weight"):
        return "normal", 0.3, 0.0
    return "normal", 0.02, 0.0


def golden_weights(cfg: KimiK3Config, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights keyed by checkpoint name; each tensor from its own generator (seed, crc32(name))."""
    out = {}
    for name, shape in shapes.items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        dist, a, b = _init_kind(name)
        if dist == "log_uniform":
            x = np.log(rng.uniform(a, b, shape))
        elif name == "lm_head.weight":
            x = rng.standard_normal(shape) / np.sqrt(cfg.hidden_size)
        else:
            x = a * rng.standard_normal(shape) + b
        out[name] = x.astype(np.float32)
    return out


def _decode(model, prompts, new: int, cache_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy token-by-token decoding through Model.step: left-padded prompt, then `new` tokens."""
    B, T = len(prompts), max(len(p) for p in prompts)
    toks = np.zeros((B, T), np.int32)
    valid = np.zeros((B, T), bool)
    for i, p in enumerate(prompts):
        toks[i, T - len(p):], valid[i, T - len(p):] = p, True
    cache = model.init_cache(B, cache_len)
    for t in range(T):
        logits, nxt, cache = model.step(cache, toks[:, t], valid[:, t])
    out_t, out_l = [np.asarray(nxt)], [np.asarray(logits)]
    for _ in range(new - 1):
        logits, nxt, cache = model.step(cache, np.asarray(nxt), np.ones(B, bool))
        out_t.append(np.asarray(nxt))
        out_l.append(np.asarray(logits))
    return np.stack(out_t, 1), np.ascontiguousarray(np.stack(out_l, 1).astype(np.float32))


def _config(mode: str) -> KimiK3Config:
    return KimiK3Config.tiny_k3() if mode == "k3" else KimiK3Config.tiny_kimi_linear()


def checkpoint_shapes(cfg: KimiK3Config) -> dict[str, tuple[int, ...]]:
    from jaxk3.model import checkpoint_shapes as shapes

    return shapes(cfg)


@pytest.fixture(autouse=True)
def xla_default_opt_level(monkeypatch, fresh_steps):
    """The model's programs compiled at XLA's default backend level, at which the digests were recorded: the suite's
    processes run XLA's CPU backend at LLVM's -O0 (tests/conftest.py, TEST_XLA_OPT_LEVEL), whose reductions add in
    another order.  The step (jaxk3.model) and the prefill and decode loop (jaxk3.generation, which imports the
    function by name and keeps its jitted programs: `fresh_steps` empties them on the way in and out, so that none
    compiled at the other level is reused) all take it."""
    import jaxk3.generation as gen
    from conftest import XLA_DEFAULT_OPTIONS

    options = jaxk3.model.compiler_options
    for module in (jaxk3.model, gen):
        monkeypatch.setattr(module, "compiler_options", lambda: {**options(), **XLA_DEFAULT_OPTIONS})


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", ["k3", "kl"])
def test_golden_tokens_and_logits(mode, tp):
    cfg = _config(mode)
    # psum="lax": the goldens predate the FFI all-reduce (a sum in rank order: other bits than lax.psum)
    model = jaxk3.Model.from_weights(cfg, golden_weights(cfg, checkpoint_shapes(cfg)), tp=tp, dtype="bfloat16",
                                     psum="lax")
    tokens, logits = _decode(model, PROMPTS, NEW, CACHE)
    np.testing.assert_array_equal(tokens, GOLDEN_TOKENS[mode])
    digests = GOLDEN_SHA256.get(jax.__version__)
    if digests is None:
        pytest.skip(f"tokens equal; no golden logits digests for jax {jax.__version__} (have: "
                    f"{sorted(GOLDEN_SHA256)}): bitwise equality is checked on those versions only")
    got = hashlib.sha256(logits.tobytes()).hexdigest()
    assert got in digests[f"{mode}/tp{tp}"], (
        f"logits digest {got} is none of the {len(digests[f'{mode}/tp{tp}'])} recorded for {mode}/tp{tp} on jax "
        f"{jax.__version__} (one per CPU code-generation family seen; a new CPU family needs its digests recorded "
        "with the code of a known-good commit on that machine)")
