"""The prefill's device time by block at Kimi-Linear-48B dims on one GPU, alone (what `jaxk3 bench generate
--breakdown` adds to its rows, without the rest of that bench): random weights (`--experts` kept, for a
short call), kernels=auto, the serving layout, one 4096-token prompt per row in the chunk
`Model.generate` picks; XLA command buffers off so that every kernel's event names its op.

    XLA_FLAGS=--xla_gpu_enable_command_buffer= python scripts/gpu/prefill_breakdown.py [--experts 64] [--batch 1]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.getcwd())
from jaxk3 import engine  # noqa: E402
from jaxk3.sharding import TP  # noqa: E402
from jaxk3.tools import bench_decode as bd  # noqa: E402
from jaxk3.tools import bench_generate as bg  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="kimi-linear-48b")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--json", default="out/prefill_breakdown.json")
    a = ap.parse_args(argv)
    full = bd.load_config(a.config)
    cfg = bd.slice_config(full, 0, full.num_hidden_layers - 1, a.experts)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (TP,))
    t0 = time.perf_counter()
    model = engine.Model(cfg, bd.random_weights(cfg, mesh, "bfloat16", shard_latent=True), mesh, "bfloat16", "auto",
                         True, "lax", donate_weights=True)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.batch, a.prompt)).tolist()
    chunk = model.prefill_chunk_for(a.batch, a.prompt)
    print(f"# {a.config}, {cfg.num_experts} experts, B {a.batch}, prompt {a.prompt}, chunk {chunk}, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__} (weights {time.perf_counter() - t0:.0f} s)", flush=True)
    res = bg.prefill_breakdown(model, prompts, chunk)
    print(bg.breakdown_line(a.batch, res), flush=True)
    if "us" in res:
        for k, v in sorted(res["us"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:6s} {v / 1e3:9.2f} ms  {100 * res['share'][k]:5.1f}%")
        print(f"  total of the program's events {res['total_us'] / 1e3:.2f} ms, unplaced {res['unplaced_us'] / 1e3:.2f} ms")
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump(dict(config=a.config, experts=cfg.num_experts, batch=a.batch, prompt=a.prompt, chunk=chunk,
                       jax=jax.__version__, device=jax.devices()[0].device_kind, result=res), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
