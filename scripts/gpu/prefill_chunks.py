"""The prefill's time against its chunk size at Kimi-Linear-48B dims on one GPU (all 256 experts,
random weights, kernels=auto, the serving layout): for each batch, a 4096-token prompt per row through
`Model.generate(..., prefill_chunk=c)` for every chunk c in CHUNKS, the chunk `auto_prefill_chunk` picks
marked; then `Model.score` of one 4K sequence beside the B = 1 prefill (same model, same run).

Per row: TTFT (the whole prefill, waited for), the best of REPS after one warm-up call that compiles.

    python scripts/gpu/prefill_chunks.py [--json PATH] [--batches 1,8] [--prompt 4096] [--config tiny]
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

REPS = 2
CHUNKS = {1: (512, 1024, 2048, 4096), 8: (256, 512, 1024)}


def _warm_then_time(fn, reps: int = 2) -> list[float]:
    """fn() once (compiles), then the seconds of each of `reps` more calls."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="out/prefill_chunks.json")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--config", default="kimi-linear-48b", help="a preset (tiny: a CPU smoke run)")
    ap.add_argument("--experts", type=int, default=0, help="routed experts kept (0: the preset's; 64 fits the 48B "
                    "on an 80 GB H100, where all 256 experts' 91.5 GB do not)")
    ap.add_argument("--chunks", default=None, help="per batch, e.g. '1:4096;8:512,1024' (default CHUNKS)")
    ap.add_argument("--score-chunks", default="", help="score also at these prefill chunks, e.g. '2048,1024' (each "
                    "chunk's logits are placed on the host while the next chunk runs)")
    a = ap.parse_args(argv)
    chunks = CHUNKS if a.chunks is None else {int(b): tuple(int(c) for c in cs.split(","))
                                               for b, cs in (p.split(":") for p in a.chunks.split(";"))}
    full = bd.load_config(a.config)
    cfg = bd.slice_config(full, 0, full.num_hidden_layers - 1, a.experts or None)  # as `bench generate --experts`
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (TP,))
    weights = bd.random_weights(cfg, mesh, "bfloat16", shard_latent=True)
    model = engine.Model(cfg, weights, mesh, "bfloat16", "auto", True, "lax", donate_weights=True)
    del weights
    kind = jax.devices()[0].device_kind
    print(f"# prefill vs chunk: {a.config}, {cfg.num_experts} experts, TP 1, {kind}, jax {jax.__version__}, prompt {a.prompt}",
          flush=True)
    rows = []
    for B in (int(b) for b in a.batches.split(",")):
        prompts = np.random.default_rng(B).integers(0, cfg.vocab_size, (B, a.prompt)).tolist()
        auto = model.prefill_chunk_for(B, a.prompt)
        for c in sorted(set(chunks.get(B, ()) + (auto,))):
            try:
                model.generate(prompts, 2, prefill_chunk=c, decode_chunk=1)
                t = min(model.generate(prompts, 2, prefill_chunk=c, decode_chunk=1).prompt_time_s for _ in range(REPS))
            except Exception as e:  # out of memory at a large chunk is a row, not the end
                print(f"B {B} chunk {c:5d}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                rows.append(dict(batch=B, chunk=c, error=str(e)[:1000]))
                continue
            model._fns.clear()
            print(f"B {B} chunk {c:5d} ({B * c:5d} tokens per dispatch){' auto' if c == auto else '     '}  "
                  f"TTFT {t:.3f} s  {B * a.prompt / t:8.0f} tok/s", flush=True)
            rows.append(dict(batch=B, chunk=c, auto=c == auto, ttft_s=t))
        if B == 1:
            t0 = time.perf_counter()
            model.score(prompts)
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.score(prompts)
            ts = time.perf_counter() - t0
            # the same call with the logits copied to the host in one piece through pageable memory (np.asarray: the
            # path before `host_slices`), the placing copy still threaded
            from jaxk3 import model as model_lib
            keep, model_lib.HOST_SLICE_BYTES = model_lib.HOST_SLICE_BYTES, 1 << 62
            t0 = time.perf_counter()
            model.score(prompts)
            t_whole = time.perf_counter() - t0
            model_lib.HOST_SLICE_BYTES = keep
            print(f"B 1 score, first call {t_first:.3f} s (compiles, allocates the pinned slices); the same with the "
                  f"logits copied in one piece (pageable): {t_whole:.3f} s", flush=True)
            # the device's part: the same prefill with every position's logits, waited for on the device
            rws = model._check_prompts(prompts)
            toks, valid, per = model._layout(rws, model._chunk(None, rws))
            t0 = time.perf_counter()
            cache = model.init_cache(toks.shape[0], -(-toks.shape[1] // engine.CACHE_BUCKET) * engine.CACHE_BUCKET)
            jax.block_until_ready(model._prefill(cache, toks, valid, per, True, None)[0])
            td = time.perf_counter() - t0
            print(f"B 1 score on the device (all logits, not copied to the host): {td:.3f} s", flush=True)
            tk = _warm_then_time(lambda: jax.block_until_ready(model.score(prompts, host=False)))  # compiles the re-layout
            print(f"B 1 score(host=False) (a jax.Array left on the device): {min(tk):.3f} s (of 2: "
                  f"{', '.join(f'{t:.3f}' for t in tk)})", flush=True)
            best = min(r["ttft_s"] for r in rows if r["batch"] == 1 and "ttft_s" in r)
            print(f"B 1 score of {a.prompt} tokens (chunk {auto}, logits at every position to the host): {ts:.3f} s, "
                  f"{ts / best:.2f}x the best prefill", flush=True)
            rows.append(dict(batch=1, score_s=ts, score_device_s=td, score_first_s=t_first, score_one_piece_s=t_whole,
                             score_on_device_s=min(tk), chunk=auto))
            for c in (int(c) for c in a.score_chunks.split(",") if c):
                tc = _warm_then_time(lambda: model.score(prompts, prefill_chunk=c))  # compiles this chunk's prefill
                print(f"B 1 score at chunk {c}: {min(tc):.3f} s (of 2: {', '.join(f'{t:.3f}' for t in tc)}), "
                      f"{min(tc) / best:.2f}x the best prefill", flush=True)
                rows.append(dict(batch=1, score_s=min(tc), score_runs_s=tc, chunk=c))
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump(dict(jax=jax.__version__, device=kind, prompt=a.prompt, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
