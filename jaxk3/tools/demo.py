"""`run_demo`: a tiny random Kimi-K3 decoded over TP CPU devices with the FFI and the lax gathers.

The process needs `tp` devices before JAX starts, e.g.
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu` (the CLI sets them).
"""
from __future__ import annotations

import statistics
from typing import Any

import jax
import numpy as np

from jaxk3 import collectives
from jaxk3.config import KimiK3Config
from jaxk3.engine import init_random_model


def _ffi_available() -> tuple[bool, str | None]:
    err_fn = getattr(collectives, "extension_error", None)
    err = err_fn() if err_fn is not None else "this jaxk3.collectives has no FFI extension"
    return err is None, err


def pick_tp(cfg: KimiK3Config, devices: int) -> tuple[int, str | None]:
    """The largest TP size <= `devices` that divides every sharded dimension of `cfg`, and why a
    larger one does not (None when it is `devices` itself)."""
    why = None
    for tp in range(devices, 0, -1):
        try:
            cfg.validate_tp(tp)
            return tp, why
        except ValueError as e:
            why = why or str(e)
    raise AssertionError("TP 1 always divides")  # pragma: no cover


def _timed_generate(model, prompts, new_tokens: int, runs: int = 3):
    """Tokens, and the decode time per token (ms) of `runs` calls after a warm-up call: the decode
    loop on the device, all new tokens in one dispatch."""
    model.generate(prompts, new_tokens, decode_chunk=new_tokens - 1)  # compile and warm up
    per = []
    for _ in range(runs):
        out = model.generate(prompts, new_tokens, decode_chunk=new_tokens - 1)
        per.append(1e3 * out.decode_time_s / (new_tokens - 1))
    return out.tokens, per


def run_demo(tp: int = 8, prompt_len: int = 8, new_tokens: int = 16, batch: int = 1, seed: int = 0,
             dtype: str = "bfloat16", verbose: bool = True) -> dict[str, Any]:
    """Generate greedily with every collective one-shot (gathers and psums through the FFI, or
    "auto" when the FFI is unavailable) and with every collective lax; check the tokens agree;
    return the decode time per token (ms) of both, from the same run."""
    if len(jax.devices()) < tp:
        raise ValueError(
            f"tp={tp} needs {tp} devices, JAX sees {len(jax.devices())}: start the process with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tp} (before JAX initialises)")
    if prompt_len < 1 or new_tokens < 2:
        raise ValueError("prompt_len must be >= 1 and new_tokens >= 2")
    cfg = KimiK3Config.tiny_k3()
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, cfg.vocab_size, size=(batch, prompt_len)).tolist()
    ok, why = _ffi_available()
    fast = "auto"
    results: dict[str, Any] = {"tp": tp, "devices": str(jax.devices()[0].platform), "batch": batch,
                               "prompt_len": prompt_len, "new_tokens": new_tokens, "fast_collectives": fast,
                               "ffi_unavailable_reason": why}
    toks = {}
    for name, impl in (("fast", fast), ("lax", "lax")):
        model = init_random_model(cfg, seed=seed, tp=tp, dtype=dtype, gather=impl, psum=impl)
        toks[name], ms = _timed_generate(model, prompts, new_tokens)
        results[f"{name}_step_ms"] = ms
        results[f"{name}_median_ms"] = statistics.median(ms)
    results["tokens"] = toks["fast"].tolist()
    results["tokens_equal"] = bool(np.array_equal(toks["fast"], toks["lax"]))
    results["speedup"] = results["lax_median_ms"] / results["fast_median_ms"]
    if verbose:
        print(f"tiny Kimi-K3, TP={tp} on {results['devices']}, batch {batch}, prompt {prompt_len}, "
              f"{new_tokens} new tokens, {dtype}; decode loop on the device, ms per token, median of "
              f"{len(results['fast_step_ms'])} runs")
        if why:
            print(f"  FFI unavailable ({why}); fast path = 'auto' (falls back to lax)")
        for name, label in (("fast", "every collective one-shot (gather=auto, psum=auto)"),
                            ("lax", "every collective lax       (gather=lax,  psum=lax) ")):
            ms = results[f"{name}_step_ms"]
            print(f"  {label}: {results[f'{name}_median_ms']:.2f} ms/token  runs: {' '.join(f'{t:.2f}' for t in ms)}")
        print(f"  one-shot vs lax: {results['speedup']:.2f}x faster per token; tokens equal: {results['tokens_equal']}"
              f"   tokens: {results['tokens'][0]}")
    return results


if __name__ == "__main__":  # pragma: no cover
    run_demo()
