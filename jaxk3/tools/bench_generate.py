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
    ttft_floor_s      the prefill's floor (`prefill_work`): per chunk the larger of its weight bytes
                      over the copy bandwidth and its exact FLOPs over the GEMM peak measured in
                      the same run (`gemm_peak`), summed over the chunks

Weights are random, generated on the devices in their final sharding (`--experts N` keeps N routed
experts per MoE layer, for memory; the per-token work is the same while N >= B·k).
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxk3.engine import Model
from jaxk3.model import StepOptions, abstract_weights, build_step, put_batch
from jaxk3.sharding import TP
from jaxk3.tools import bench_decode as bd


def run(config: str = "kimi-linear-48b", tp: int = 1, batches=(1, 8), prompt: int = 4096, new: int = 256,
        experts: int | None = None, dtype: str = "bfloat16", gather: str = "auto", psum: str = "lax",
        prefill_chunk: int | None = None, decode_chunk: int = 64, copy_bytes: int = 1 << 30, progress=None,
        baseline_chunk: int | None = None, breakdown: bool = False) -> dict:
    """`prefill_chunk` None: the chunk `Model.generate` picks per batch (engine.auto_prefill_chunk).
    `baseline_chunk`: also the prefill with every device kernel off at that chunk (the dense MoE form),
    the same weights in the same process: `baseline_ttft_s` and `ttft_speedup` per row.  `breakdown`:
    the prefill's device time by block from a profile (`prefill_breakdown`), per row."""
    from jaxk3 import engine

    say = progress or (lambda m: None)
    full = bd.load_config(config)
    cfg = bd.slice_config(full, 0, full.num_hidden_layers - 1, experts)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:tp]), (TP,))
    cfg.validate_tp(tp)
    say(f"copy bandwidth ({copy_bytes >> 20} MiB per device), GEMM peak")
    bw = bd.copy_bandwidth(mesh, copy_bytes)
    peak = gemm_peak(mesh)
    say("random weights on the devices")
    t0 = time.perf_counter()
    weights = bd.random_weights(cfg, mesh, dtype, shard_latent=True)
    jax.block_until_ready(weights)
    init_s = time.perf_counter() - t0
    wbytes_of = {B: sum(bd.weight_bytes_per_rank(cfg, weights, B).values()) for B in batches}  # either layout's
    kind = jax.devices()[0].device_kind if jax.devices()[0].platform != "cpu" else "cpu"
    chunk_of = {B: prefill_chunk or engine.auto_prefill_chunk(cfg, B, prompt, kind, jnp.dtype(dtype).itemsize, tp)
                for B in batches}
    work_of = {B: prefill_work(cfg, B, prompt, chunk_of[B], tp, (abstract_weights(cfg, tp), weights),
                               lambda n: sum(bd.weight_bytes_per_rank(cfg, weights, n).values())) for B in batches}
    model = Model(cfg, weights, mesh, dtype, gather, True, psum, donate_weights=True)  # serving layout on GPUs
    del weights
    base_model = model.with_kernels("off") if baseline_chunk else None
    rows = []
    for B in batches:
        chunk = chunk_of[B]
        rng = np.random.default_rng(B)
        prompts = rng.integers(0, cfg.vocab_size, (B, prompt)).tolist()
        say(f"B={B}: warm-up: the same call once (compiles the prefill, chunk {chunk}, and the decode loop)")
        t0 = time.perf_counter()
        model.generate(prompts, new, prefill_chunk=chunk, decode_chunk=decode_chunk)
        compile_s = time.perf_counter() - t0
        say(f"B={B}: prompt {prompt} + {new} new tokens")
        out = model.generate(prompts, new, prefill_chunk=chunk, decode_chunk=decode_chunk)
        ttft, dec = out.prompt_time_s, out.decode_time_s
        base_ttft = None
        if base_model is not None:
            say(f"B={B}: baseline prefill: kernels off, chunk {baseline_chunk} (warm-up, then timed)")
            base_model.generate(prompts, 2, prefill_chunk=baseline_chunk, decode_chunk=1)
            base_ttft = base_model.generate(prompts, 2, prefill_chunk=baseline_chunk, decode_chunk=1).prompt_time_s
            base_model._fns.clear()
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
        work = work_of[B]
        ttft_floor = sum(max(c["bytes"] / bw, c["flops"] / peak) for c in work)
        by_block = None
        if breakdown:
            say(f"B={B}: the prefill's device time by block (compile, one warm-up, one profiled run)")
            by_block = prefill_breakdown(model, prompts, chunk)
            say("   " + breakdown_line(B, by_block))
        row = dict(batch=B, prompt=prompt, new=new, prefill_chunk=chunk, ttft_s=ttft, baseline_chunk=baseline_chunk,
                   prefill_by_block=by_block,
                   baseline_ttft_s=base_ttft, ttft_speedup=base_ttft / ttft if base_ttft else None, prefill_tok_s=B * prompt / ttft,
                   decode_tok_s=B * (new - 1) / dec if dec > 0 else float("nan"), loop_us_per_token=per_tok,
                   step_us_b2b=b2b, loop_vs_b2b=b2b / per_tok, token_by_token_s=prompt * b2b / 1e6,
                   prefill_speedup=prompt * b2b / 1e6 / ttft, floor_us=floor, b2b_vs_floor=b2b / floor,
                   weight_bytes=wbytes, cache_bytes=cbytes, compile_s=compile_s,
                   ttft_floor_s=ttft_floor, ttft_vs_floor=ttft / ttft_floor,
                   prefill_flops=sum(c["flops"] for c in work), prefill_bytes=sum(c["bytes"] for c in work),
                   ttft_compute_s=sum(c["flops"] for c in work) / peak,
                   ttft_bytes_s=sum(c["bytes"] for c in work) / bw,
                   stopped_rows=int((out.lengths < new).sum()), compiled_variants=compiled)
        rows.append(row)
        say(f"   -> TTFT {ttft:.3f} s" + (f" (baseline {base_ttft:.3f} s: x{base_ttft / ttft:.2f})" if base_ttft else "")
            + f" ({row['prefill_tok_s']:.0f} tok/s, {row['prefill_speedup']:.1f}x token by token; "
            f"floor {ttft_floor:.3f} s: {row['prefill_flops'] / 1e12:.2f} TFLOP, {row['prefill_bytes'] / 1e9:.1f} GB), "
            f"decode {row['decode_tok_s']:.1f} tok/s ({per_tok:.0f} us/token vs {b2b:.0f} us back to back: "
            f"x{row['loop_vs_b2b']:.3f}), floor {floor:.0f} us")
    return {"kind": "generate", "config": config, "layers": cfg.num_hidden_layers, "experts": cfg.num_experts, "tp": tp,
            "dtype": dtype, "gather": gather, "psum": psum, "layout": model.layout, "prefill_chunk": prefill_chunk or "auto",
            "decode_chunk": decode_chunk, "platform": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind, "copy_bandwidth_GBps": bw / 1e9,
            "gemm_peak_TFLOPs": peak / 1e12, "weights_init_s": init_s,
            "versions": bd._versions(), "rows": rows}


def prefill_breakdown(model: Model, prompts, chunk: int) -> dict:
    """Device time of one prefill of `prompts` (chunks of `chunk` tokens per row) by block, from a
    profile: the compiled prefill's ops placed in model.forward_local's named-scope blocks (embed,
    layer{g}_{kda|mla|moe|mlp}, head: jaxk3.tools.census), every chunk run once after an unprofiled
    warm-up.  Returns {"us": {kind: µs per prefill}, "share": {kind: of the placed time}, "chunks", "chunk",
    "total_us", "unplaced_us", "source"} or {"unavailable": why}."""
    import re
    import shutil
    import tempfile

    from jaxk3 import engine, generation
    from jaxk3.model import put_rows
    from jaxk3.tools import census

    rows = model._check_prompts(prompts)
    toks, valid, per = model._layout(rows, chunk)
    parts = [(put_rows(toks[:, c0:c0 + per], model.mesh), put_rows(valid[:, c0:c0 + per], model.mesh))
             for c0 in range(0, toks.shape[1], per)]

    def fresh():
        return model.init_cache(toks.shape[0], -(-(toks.shape[1] + 1) // engine.CACHE_BUCKET) * engine.CACHE_BUCKET)

    fn = generation.build_prefill(model.cfg, model.opt, model.mesh, False, None)
    compiled = fn.lower(model.weights, fresh(), *parts[0], np.int32(0)).compile()
    kc = census.kernel_census(compiled.as_text(), bd.block_names(model.cfg))

    def run():
        cache = fresh()
        jax.block_until_ready(cache)
        for t, v in parts:
            out, _, _, cache = compiled(model.weights, cache, t, v, np.int32(0))
        jax.block_until_ready(out)

    run()  # warm-up: finished before the trace starts
    trace_dir = tempfile.mkdtemp(prefix="jaxk3_prefill_")
    try:
        try:
            with jax.profiler.trace(trace_dir):
                run()
            times = census.profile_times(census.find_xplane(trace_dir), kc, 1)
        except census.ProfileUnavailable as e:
            return {"unavailable": str(e)}
        except Exception as e:  # another trace running, no profiler plugin (CUPTI), ...
            return {"unavailable": f"the profiler did not run ({type(e).__name__}: {e})"}
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    us: dict[str, float] = {}
    for block, t in times["us"].items():
        m = re.fullmatch(r"layer\d+_(\w+)", block)
        kind = m.group(1) if m else block
        us[kind] = us.get(kind, 0.0) + t
    placed = sum(us.values())
    return {"us": us, "share": {k: v / placed for k, v in us.items()} if placed else {}, "chunks": len(parts),
            "chunk": per, "total_us": times["total_us"], "unplaced_us": times["unattributed_us"],
            "source": times["source"]}


def breakdown_line(B: int, bd_: dict) -> str:
    """One line of `prefill_breakdown`'s result."""
    if "unavailable" in bd_:
        return f"B={B} prefill by block: unavailable ({bd_['unavailable']})"
    kinds = sorted(bd_["us"], key=lambda k: -bd_["us"][k])
    return (f"B={B} prefill by block (device time, {bd_['chunks']} chunk(s) of {bd_['chunk']}, {bd_['source']}): "
            + ", ".join(f"{k} {bd_['us'][k] / 1e3:.1f} ms ({100 * bd_['share'][k]:.0f}%)" for k in kinds)
            + f"; unplaced {bd_['unplaced_us'] / 1e3:.1f} ms")


def matmul_elements(cfg, tree=None) -> tuple[float, float]:
    """(the weight elements one token multiplies in the matmuls, the lm_head's), per rank
    (params.matmul_elements: the routed experts at k of E).  `tree`: the Params with the per-rank arrays
    beside them (`(params, arrays)`), else the whole model's shapes (TP 1)."""
    from jaxk3 import params

    abstract, arrays = tree if tree is not None else (abstract_weights(cfg, 1), None)
    return params.matmul_elements(abstract, arrays, expert_fraction=cfg.num_experts_per_token / cfg.num_experts)


def attention_flops(cfg, tp: int, start: int, n: int) -> float:
    """FLOPs per row, per rank, of the token mixing for positions [start, start + n) over their prefix:
    MLA causal attention 2·H·(d_qk + d_v) per (query, key) pair, KDA's recurrent form 6·H·d² per token
    (q·S, k·S, the outer update; the chunk form does more but this is the work the tokens need)."""
    pairs = n * start + n * (n + 1) / 2
    mla = len(cfg.mla_layers) * 2 * (cfg.num_attention_heads / tp) * (cfg.qk_head_dim + cfg.v_head_dim) * pairs
    kda = len(cfg.kda_layers) * 6 * (cfg.kda_num_heads / tp) * cfg.kda_head_dim ** 2 * n
    return float(mla + kda)


def prefill_work(cfg, batch: int, prompt: int, chunk: int, tp: int = 1, tree=None,
                 bytes_of_chunk=None) -> list[dict]:
    """Per prefill chunk of `chunk` tokens per row (the last one may be shorter): its exact FLOPs per
    rank (2 x the matmul weights each token multiplies, `matmul_elements`, + `attention_flops`, + the
    head on the last position of each row in the last chunk) and, with `bytes_of_chunk(tokens)`, the
    weight bytes it reads (each distinct expert its tokens touch once)."""
    tok, head = matmul_elements(cfg, tree)
    out = []
    for c0 in range(0, prompt, chunk):
        n = min(chunk, prompt - c0)
        flops = batch * (2 * tok * n + attention_flops(cfg, tp, c0, n))
        if c0 + n >= prompt:
            flops += 2 * head * batch
        out.append(dict(tokens=batch * n, flops=flops,
                        bytes=bytes_of_chunk(batch * n) if bytes_of_chunk else None))
    return out


def gemm_peak(mesh, n: int | None = None, dtype=jnp.bfloat16) -> float:
    """FLOP/s per device of one [n, n] x [n, n] GEMM (fp32 accumulate), the median of 5 rounds of 5 calls:
    the compute rate the TTFT floor divides by (n = 8192 on GPUs, 512 on the CPU)."""
    n = n or (512 if mesh.devices.flat[0].platform == "cpu" else 8192)
    a = jax.device_put(jnp.ones((n, n), dtype) * 0.5, mesh.devices.flat[0])
    f = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32))
    jax.block_until_ready(f(a))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(5):
            y = f(a)
        jax.block_until_ready(y)
        ts.append((time.perf_counter() - t0) / 5)
    return 2.0 * n ** 3 / statistics.median(ts)


def table(res: dict) -> str:
    head = (f"{'B':>3} | {'prompt':>6} | {'new':>4} | {'chunk':>5} | {'TTFT s':>7} | {'prefill tok/s':>13} | {'x tok-by-tok':>12} | "
            f"{'decode tok/s':>12} | {'us/tok loop':>11} | {'us/step b2b':>11} | {'b2b/loop':>8} | {'floor us':>8} | "
            f"{'b2b/floor':>9} | {'TTFT floor s':>12} | {'TTFT/floor':>10} | {'base TTFT s':>11} | {'x base':>6}")
    lines = [f"generate: {res['config']} ({res['layers']} layers, {res['experts']} routed experts), TP {res['tp']} x "
             f"{res['device_kind']}, {res['dtype']}, prefill chunk {res['prefill_chunk']}, decode chunk "
             f"{res['decode_chunk']}, jax {res['versions']['jax']}; copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s, "
             f"GEMM peak {res['gemm_peak_TFLOPs']:.1f} TFLOP/s",
             head, "-" * len(head)]
    for r in res["rows"]:
        base = (f"{r['baseline_ttft_s']:>11.3f} | {r['ttft_speedup']:>6.2f}" if r.get("baseline_ttft_s")
                else f"{'-':>11} | {'-':>6}")
        lines.append(f"{r['batch']:>3} | {r['prompt']:>6} | {r['new']:>4} | {r.get('prefill_chunk', '-'):>5} | {r['ttft_s']:>7.3f} | "
                     f"{r['prefill_tok_s']:>13.0f} | {r['prefill_speedup']:>12.1f} | {r['decode_tok_s']:>12.1f} | "
                     f"{r['loop_us_per_token']:>11.0f} | {r['step_us_b2b']:>11.0f} | {r['loop_vs_b2b']:>8.3f} | "
                     f"{r['floor_us']:>8.0f} | {r['b2b_vs_floor']:>9.2f} | {r['ttft_floor_s']:>12.3f} | "
                     f"{r['ttft_vs_floor']:>10.2f} | {base}")
    lines += [breakdown_line(r["batch"], r["prefill_by_block"]) for r in res["rows"] if r.get("prefill_by_block")]
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
                   new: int = 256, experts: int | None = None, dtype: str = "bfloat16", prefill_chunk: int | None = None,
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
    kind = devices[0].device_kind if devices[0].platform != "cpu" else "cpu"
    padded = max(engine.prefill_layout(prompt, prefill_chunk or engine.auto_prefill_chunk(
        cfg, B, prompt, kind, jnp.dtype(dtype).itemsize, tp))[0] for B in batches)
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
