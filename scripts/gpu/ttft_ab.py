"""The 48B's B = 1 TTFT with a module constant of the kernels (or of jaxk3) off and on, in one process on the same
weights: two models sharing the weights, each compiled under its setting (the constant is read at trace time),
then timed in alternation (REPS rounds, each a model's prefill of the whole prompt in one chunk + 2 tokens); the
two must give the same tokens.  What a prefill change does to the first token, against the form before, same run.

    python scripts/gpu/ttft_ab.py moe_grouped:MASK     # False, then True (main); prints on / off
    REPS=4 PROMPT=4096 EXPERTS=64 CONFIG=kimi-linear-48b python scripts/gpu/ttft_ab.py moe_grouped:MASK
    CONFIG=tiny PROMPT=64 EXPERTS=0 REPS=1 python scripts/gpu/ttft_ab.py moe_grouped:MASK   # a CPU smoke run

MODULE is a module of jaxk3.kernels, or one spelled from `jaxk3.`; the constant is set False for the first model and
True for the second, and left True (the thirty-fourth section's split and the fortieth's mask were timed this way).
"""
import importlib
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.getcwd())
from jaxk3 import engine, generation  # noqa: E402
from jaxk3.sharding import TP  # noqa: E402
from jaxk3.tools import bench_decode as bd  # noqa: E402


def main(flag: str) -> None:
    mod_name, name = flag.split(":")
    mod = importlib.import_module(mod_name if mod_name.startswith("jaxk3.") else f"jaxk3.kernels.{mod_name}")
    if not isinstance(getattr(mod, name), bool):
        raise SystemExit(f"{flag}: not a boolean constant of {mod.__name__}")
    reps = int(os.environ.get("REPS", "4"))
    full = bd.load_config(os.environ.get("CONFIG", "kimi-linear-48b"))
    P = int(os.environ.get("PROMPT", "4096"))
    cfg = bd.slice_config(full, 0, full.num_hidden_layers - 1, int(os.environ.get("EXPERTS", "64")) or None)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (TP,))
    weights = bd.random_weights(cfg, mesh, "bfloat16", shard_latent=True)
    on_model = engine.Model(cfg, weights, mesh, "bfloat16", "auto", True, "lax", donate_weights=True)
    del weights
    off_model = on_model.with_kernels("auto")
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, P)).tolist()
    models = {}
    for label, m, on in ((f"{name} off", off_model, False), (f"{name} on (main)", on_model, True)):
        setattr(mod, name, on)
        generation.build_prefill.cache_clear()  # a jit of its own for each model: the constant is read when traced
        t0 = time.perf_counter()
        out = m.generate(prompts, 2, prefill_chunk=P, decode_chunk=1)  # compiles under this setting
        print(f"{label}: compiled in {time.perf_counter() - t0:.1f} s; tokens {out.tokens[0]}", flush=True)
        models[label] = (m, out.tokens)
    setattr(mod, name, True)
    times = {n: [] for n in models}
    for _ in range(reps):
        for label, (m, toks) in models.items():
            out = m.generate(prompts, 2, prefill_chunk=P, decode_chunk=1)
            assert np.array_equal(out.tokens, toks), (label, out.tokens, toks)
            times[label].append(out.prompt_time_s)
    for label, ts in times.items():
        print(f"{label}: TTFT min {min(ts):.4f} s, median {sorted(ts)[len(ts) // 2]:.4f} s "
              f"({', '.join(f'{t:.4f}' for t in ts)})", flush=True)
    a, b = (min(ts) for ts in times.values())
    print(f"{name} on / off: {b / a:.3f} (min over {reps}); {jax.devices()[0].device_kind}, jax {jax.__version__}",
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
