"""The prefill's device time by block at Kimi-Linear-48B dims on one GPU, alone (what `jaxk3 bench generate
--breakdown` adds to its rows, without the rest of that bench): random weights (`--experts` kept, for a
short call), kernels=auto, the serving layout, one 4096-token prompt per row in the chunk
`Model.generate` picks; XLA command buffers off so that every kernel's event names its op.

    XLA_FLAGS=--xla_gpu_enable_command_buffer= python scripts/gpu/prefill_breakdown.py [--experts 64] [--batch 1]
        [--layers 0-3] [--kda-form scan|allchunks|kernel [--kda-config k=v,...]] [--top 15]

--layers keeps a slice of the model's layers; --kda-form allchunks runs KDA's prefill with the all-chunks form
tried on 2026-12-02 (scripts/gpu/prefill_attention.py) instead of the model's, --kda-form scan the per-chunk scan
(the kernel's reference), --kda-form kernel the kda_prefill kernel in the --kda-config given; --top lists the prefill's N
longest kernels by total device time from a second, profiled run.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jaxk3 import engine  # noqa: E402
from jaxk3.kernels import kda_prefill as KP  # noqa: E402
from jaxk3.kernels import registry  # noqa: E402
from jaxk3.sharding import TP  # noqa: E402
from jaxk3.tools import bench_decode as bd  # noqa: E402
from jaxk3.tools import bench_generate as bg  # noqa: E402


def top_kernels(model, prompts, chunk: int, n: int) -> list[tuple[str, float, int]]:
    """The n kernels of one prefill (after a warm-up) with the most device time: (name, us, count)."""
    import collections
    import glob
    import tempfile

    from jax.profiler import ProfileData

    model.generate(prompts, max_new_tokens=1, prefill_chunk=chunk)  # warm: compiled, caches made
    d = tempfile.mkdtemp(prefix="jaxk3_top_")
    with jax.profiler.trace(d):
        model.generate(prompts, max_new_tokens=1, prefill_chunk=chunk)
    path = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]
    us, count = collections.Counter(), collections.Counter()
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:") or "CPU" in plane.name:
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                us[ev.name] += ev.duration_ns / 1e3
                count[ev.name] += 1
    return [(k, v, count[k]) for k, v in us.most_common(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="kimi-linear-48b")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--json", default="out/prefill_breakdown.json")
    ap.add_argument("--layers", default=None, help="first-last (inclusive), default all")
    ap.add_argument("--kda-form", choices=("auto", "scan", "allchunks", "kernel"), default="auto")
    ap.add_argument("--kda-config", default="",
                    help="--kda-form kernel: the kda_prefill Config, k=v,...")
    ap.add_argument("--top", type=int, default=0)
    a = ap.parse_args(argv)
    full = bd.load_config(a.config)
    first, last = (int(x) for x in a.layers.split("-")) if a.layers else (0, full.num_hidden_layers - 1)
    cfg = bd.slice_config(full, first, last, a.experts)
    k = registry.REGISTRY["kda_prefill"]
    if a.kda_form in ("scan", "allchunks"):  # no device kernel: auto runs the reference (swapped for allchunks)
        import prefill_attention
        ref = prefill_attention.allchunks_form if a.kda_form == "allchunks" else k.reference
        registry.REGISTRY["kda_prefill"] = dataclasses.replace(k, reference=ref, platforms=())
    if a.kda_form == "kernel":  # kernels=auto takes kda_prefill in this config
        kw = {k: (int(v) if v.isdigit() else v) for k, v in (x.split("=") for x in a.kda_config.split(",") if x)}
        c = KP.Config(**kw)
        registry.REGISTRY["kda_prefill"] = dataclasses.replace(
            k, unproven=None, device=functools.partial(KP.chunked, config=c), fits=functools.partial(KP.fits, config=c))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (TP,))
    t0 = time.perf_counter()
    model = engine.Model(cfg, bd.random_weights(cfg, mesh, "bfloat16", shard_latent=True), mesh, "bfloat16", "auto",
                         True, "lax", donate_weights=True)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.batch, a.prompt)).tolist()
    chunk = model.prefill_chunk_for(a.batch, a.prompt)
    print(f"# {a.config} layers {first}-{last}, KDA form {a.kda_form}, {cfg.num_experts} experts, B {a.batch}, prompt {a.prompt}, chunk {chunk}, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__} (weights {time.perf_counter() - t0:.0f} s)", flush=True)
    res = bg.prefill_breakdown(model, prompts, chunk)
    print(bg.breakdown_line(a.batch, res), flush=True)
    if "us" in res:
        for k, v in sorted(res["us"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:6s} {v / 1e3:9.2f} ms  {100 * res['share'][k]:5.1f}%")
        print(f"  total of the program's events {res['total_us'] / 1e3:.2f} ms, unplaced {res['unplaced_us'] / 1e3:.2f} ms")
    if a.top:
        res["top"] = top_kernels(model, prompts, chunk, a.top)
        for name, us, n in res["top"]:
            print(f"  {us / 1e3:9.3f} ms  {n:6d} x  {name[:150]}")
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump(dict(config=a.config, experts=cfg.num_experts, batch=a.batch, prompt=a.prompt, chunk=chunk,
                       jax=jax.__version__, device=jax.devices()[0].device_kind, result=res), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
