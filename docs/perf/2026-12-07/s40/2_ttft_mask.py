"""Fortieth session (from the thirty-fourth's 7_ttft_split.py): the 48B's B = 1 TTFT (a 4096-token prompt, chunk 4096,
64 experts kept) with the grouped GEMM's padding masked and kernel 2 on the 128-row blocks (moe_grouped.MASK,
config_for's choice now) and without (the split on 64-row halves), in one process on the same weights:
two models sharing the weights, each compiled under its setting, then timed in alternation (REPS rounds, each a
model's prefill + 2 tokens)."""
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.getcwd())
from jaxk3 import engine, generation  # noqa: E402
from jaxk3.kernels import moe_grouped as G  # noqa: E402
from jaxk3.sharding import TP  # noqa: E402
from jaxk3.tools import bench_decode as bd  # noqa: E402

REPS = int(os.environ.get("REPS", "4"))
full = bd.load_config(os.environ.get("CONFIG", "kimi-linear-48b"))  # tiny: a CPU smoke run
P = int(os.environ.get("PROMPT", "4096"))
cfg = bd.slice_config(full, 0, full.num_hidden_layers - 1, int(os.environ.get("EXPERTS", "64")) or None)
mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (TP,))
weights = bd.random_weights(cfg, mesh, "bfloat16", shard_latent=True)
split = engine.Model(cfg, weights, mesh, "bfloat16", "auto", True, "lax", donate_weights=True)
del weights
plain = split.with_kernels("auto")
prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, P)).tolist()
models = {}
for name, m, on in (("MASK off", plain, False), ("MASK on (main)", split, True)):
    G.MASK = on
    generation.build_prefill.cache_clear()  # a jit of its own for each model: MASK is read at trace time
    t0 = time.perf_counter()
    out = m.generate(prompts, 2, prefill_chunk=P, decode_chunk=1)  # compiles under this setting
    print(f"{name}: compiled in {time.perf_counter() - t0:.1f} s; tokens {out.tokens[0]}", flush=True)
    models[name] = (m, out.tokens)
G.MASK = True
times = {n: [] for n in models}
for r in range(REPS):
    for name, (m, toks) in models.items():
        out = m.generate(prompts, 2, prefill_chunk=P, decode_chunk=1)
        assert np.array_equal(out.tokens, toks), (name, out.tokens, toks)
        times[name].append(out.prompt_time_s)
for name, ts in times.items():
    print(f"{name}: TTFT min {min(ts):.4f} s, median {sorted(ts)[len(ts) // 2]:.4f} s ({', '.join(f'{t:.4f}' for t in ts)})",
          flush=True)
a, b = (min(ts) for ts in times.values())
print(f"MASK on / off: {b / a:.3f} (min over {REPS}); {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
