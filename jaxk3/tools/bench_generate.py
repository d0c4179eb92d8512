"""`jaxk3 bench generate`: what a user feels, at real model dimensions, against the same run's baselines.

For each batch size: a random prompt of P tokens per row, then N new tokens through
`Model.generate` (chunked prefill, the decode loop on the device), after one warm-up run that
compiles both.  Reported, each beside its baseline measured in the same process:

    ttft_s            time to first token (the whole prefill, waited for)
    prefill_tok_s     B·P / ttft
    decode_tok_s      user-facing: B·(N-1) / the time from the first new token to the last
    step_us_b2b       one decode step enqueued back to back (the greedy token fed back on the
                      device, nothing waited for): the device's own step rate
    loop_vs_b2b       step_us_b2b / (decode time per token): >= 0.95 means the host costs <= 5 %
    token_by_token_s  the old prompt path, estimated as P steps at the back-to-back rate
    prefill_speedup   token_by_token_s / ttft
    floor_us          weight bytes one rank reads per step (experts: the distinct ones a step is
                      expected to touch, E·(1-(1-k/E)^B)) + cache bytes, over the copy bandwidth

Weights are random, generated on the devices in their final sharding (`--experts N` keeps N routed
experts per MoE layer, for memory; the per-token work is the same while N >= B·k).
"""
from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from jaxk3.engine import Model
from jaxk3.model import StepOptions, build_step, put_batch
from jaxk3.sharding import TP
from jaxk3.tools import bench_decode as bd


def run(config: str = "kimi-linear-48b", tp: int = 1, batches=(1, 8), prompt: int = 4096, new: int = 256,
        experts: int | None = None, dtype: str = "bfloat16", gather: str = "auto", psum: str = "lax",
        prefill_chunk: int = 512, decode_chunk: int = 64, copy_bytes: int = 1 << 30, progress=None) -> dict:
    say = progress or (lambda m: None)
    full = bd.load_config(config)
    cfg = bd.slice_config(full, 0, full.num_hidden_layers - 1, experts)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:tp]), (TP,))
    cfg.validate_tp(tp)
    say(f"copy bandwidth ({copy_bytes >> 20} MiB per device)")
    bw = bd.copy_bandwidth(mesh, copy_bytes)
    say("random weights on the devices")
    t0 = time.perf_counter()
    weights = bd.random_weights(cfg, mesh, dtype, shard_latent=True)
    jax.block_until_ready(weights)
    init_s = time.perf_counter() - t0
    wbytes_of = {B: sum(bd.weight_bytes_per_rank(cfg, weights, B).values()) for B in batches}  # either layout's
    model = Model(cfg, weights, mesh, dtype, gather, True, psum, donate_weights=True)  # serving layout on GPUs
    del weights
    rows = []
    for B in batches:
        rng = np.random.default_rng(B)
        prompts = rng.integers(0, cfg.vocab_size, (B, prompt)).tolist()
        say(f"B={B}: warm-up: the same call once (compiles the prefill and the decode loop)")
        t0 = time.perf_counter()
        model.generate(prompts, new, prefill_chunk=prefill_chunk, decode_chunk=decode_chunk)
        compile_s = time.perf_counter() - t0
        say(f"B={B}: prompt {prompt} + {new} new tokens")
        out = model.generate(prompts, new, prefill_chunk=prefill_chunk, decode_chunk=decode_chunk)
        ttft, dec = out.prompt_time_s, out.decode_time_s
        compiled = {k[0]: f._cache_size() for k, f in model._fns.items()}
        # the device's own step rate: the decode step back to back, greedy token fed back on the device
        step = build_step(cfg, StepOptions(gather=gather, psum=psum, serving=model.serving), mesh)
        cache = bd.random_cache(cfg, mesh, dtype, B, -(-(prompt + new) // 64) * 64)
        ids = put_batch(np.arange(B, dtype=np.int32) % cfg.vocab_size, mesh)
        valid = put_batch(np.ones((B,), bool), mesh)
        for _ in range(3):
            _, ids, cache = step(model.weights, cache, ids, valid)
        ids.block_until_ready()
        per = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20):
                _, ids, cache = step(model.weights, cache, ids, valid)
            ids.block_until_ready()
            per.append((time.perf_counter() - t0) / 20 * 1e6)
        b2b = statistics.median(per)
        wbytes = wbytes_of[B]
        cbytes = bd.cache_bytes_per_rank(cfg, cache)
        del cache
        floor = (wbytes + cbytes) / bw * 1e6
        per_tok = dec / max(new - 1, 1) * 1e6
        row = dict(batch=B, prompt=prompt, new=new, ttft_s=ttft, prefill_tok_s=B * prompt / ttft,
                   decode_tok_s=B * (new - 1) / dec if dec > 0 else float("nan"), loop_us_per_token=per_tok,
                   step_us_b2b=b2b, loop_vs_b2b=b2b / per_tok, token_by_token_s=prompt * b2b / 1e6,
                   prefill_speedup=prompt * b2b / 1e6 / ttft, floor_us=floor, b2b_vs_floor=b2b / floor,
                   weight_bytes=wbytes, cache_bytes=cbytes, compile_s=compile_s,
                   stopped_rows=int((out.lengths < new).sum()), compiled_variants=compiled)
        rows.append(row)
        say(f"   -> TTFT {ttft:.3f} s ({row['prefill_tok_s']:.0f} tok/s, {row['prefill_speedup']:.1f}x token by token), "
            f"decode {row['decode_tok_s']:.1f} tok/s ({per_tok:.0f} us/token vs {b2b:.0f} us back to back: "
            f"x{row['loop_vs_b2b']:.3f}), floor {floor:.0f} us")
    return {"kind": "generate", "config": config, "layers": cfg.num_hidden_layers, "experts": cfg.num_experts, "tp": tp,
            "dtype": dtype, "gather": gather, "psum": psum, "layout": model.layout, "prefill_chunk": prefill_chunk,
            "decode_chunk": decode_chunk, "platform": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind, "copy_bandwidth_GBps": bw / 1e9, "weights_init_s": init_s,
            "versions": bd._versions(), "rows": rows}


def table(res: dict) -> str:
    head = (f"{'B':>3} | {'prompt':>6} | {'new':>4} | {'TTFT s':>7} | {'prefill tok/s':>13} | {'x tok-by-tok':>12} | "
            f"{'decode tok/s':>12} | {'us/tok loop':>11} | {'us/step b2b':>11} | {'b2b/loop':>8} | {'floor us':>8} | "
            f"{'b2b/floor':>9}")
    lines = [f"generate: {res['config']} ({res['layers']} layers, {res['experts']} routed experts), TP {res['tp']} x "
             f"{res['device_kind']}, {res['dtype']}, prefill chunk {res['prefill_chunk']}, decode chunk "
             f"{res['decode_chunk']}, jax {res['versions']['jax']}; copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s",
             head, "-" * len(head)]
    for r in res["rows"]:
        lines.append(f"{r['batch']:>3} | {r['prompt']:>6} | {r['new']:>4} | {r['ttft_s']:>7.3f} | "
                     f"{r['prefill_tok_s']:>13.0f} | {r['prefill_speedup']:>12.1f} | {r['decode_tok_s']:>12.1f} | "
                     f"{r['loop_us_per_token']:>11.0f} | {r['step_us_b2b']:>11.0f} | {r['loop_vs_b2b']:>8.3f} | "
                     f"{r['floor_us']:>8.0f} | {r['b2b_vs_floor']:>9.2f}")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    bs = [str(r["batch"]) for r in res["rows"]]
    axes[0].bar(bs, [r["ttft_s"] for r in res["rows"]], label="prefill (TTFT)")
    axes[0].bar(bs, [r["token_by_token_s"] for r in res["rows"]], alpha=0.3, label="token by token (est.)")
    axes[0].set_ylabel("s for the prompt"), axes[0].set_xlabel("batch"), axes[0].legend(fontsize=8)
    x = np.arange(len(bs))
    axes[1].bar(x - 0.2, [r["loop_us_per_token"] for r in res["rows"]], 0.4, label="decode loop, per token")
    axes[1].bar(x + 0.2, [r["step_us_b2b"] for r in res["rows"]], 0.4, label="step back to back")
    for i, r in enumerate(res["rows"]):
        axes[1].hlines(r["floor_us"], i - 0.4, i + 0.4, colors="k", linestyles="dashed",
                       label="bandwidth floor" if i == 0 else None)
    axes[1].set_xticks(x, bs), axes[1].set_ylabel("us per step"), axes[1].set_xlabel("batch"), axes[1].legend(fontsize=8)
    fig.suptitle(f"{res['config']}, TP{res['tp']} {res['device_kind']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def memory_problem(config: str = "kimi-linear-48b", tp: int = 1, batches=(1, 8), prompt: int = 4096,
                   new: int = 256, experts: int | None = None, dtype: str = "bfloat16", prefill_chunk: int = 512,
                   decode_chunk: int = 64, devices: list | None = None) -> str | None:
    """Whether `run(...)` fits this machine, before anything is allocated: the problem (what the run
    needs per rank, weights + the decode cache of the largest batch, and what the devices have:
    device memory, or the host's memory shared by every CPU device), or None."""
    from jaxk3 import engine
    from jaxk3.tools import memory

    full = bd.load_config(config)
    cfg = bd.slice_config(full, 0, full.num_hidden_layers - 1, experts)
    cfg.validate_tp(tp)
    devices = list(devices if devices is not None else jax.devices()[:tp])
    weights = sum(memory.weight_bytes_per_rank(cfg, tp, dtype).values())
    padded, _ = engine.prefill_layout(prompt, prefill_chunk)
    bucket = engine.CACHE_BUCKET
    positions = -(-(padded + new + decode_chunk) // bucket) * bucket
    B = max(batches)
    cache = memory.cache_bytes(cfg, B, positions, tp, dtype)
    what = f"--config {config} at TP {tp} ({cfg.num_hidden_layers} layers, {cfg.num_experts} routed experts, {dtype})"
    detail = (f"weights {memory.human_bytes(weights)} + decode cache {memory.human_bytes(cache)} for batch {B} x "
              f"{positions} positions")
    problem = memory.fit_problem(weights + cache, what, devices, detail)
    if problem is None:
        return None
    hint = ("it is sized for a GPU: run it on one, or try --config tiny here" if devices[0].platform == "cpu"
            else "use a larger --tp, fewer --experts or a smaller --batch / --prompt")
    return f"{problem}; {hint}"
