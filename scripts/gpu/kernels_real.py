"""Each device kernel against its XLA (jnp reference) path at the real per-rank shapes of the presets
(the cases of tests/test_kernels_real.py: K3 at TP 1/2/8, Kimi-Linear-48B at TP 1), B = 1 and 8.

Per case and path: one jit holding a fori_loop of CHAIN dependent calls, each call's output fed back
into its next input the way the step chains them (rms_norm: the normed row becomes the next input;
kda_decode: the new conv window and state; mla_decode: the output becomes the next query;
moe_experts: the output becomes the next z; router: the weights nudge the next logits).
Time per call: the median over REPS of (wall time of INNER back-to-back calls) / (INNER * CHAIN).
The relative error of the kernel against the reference (one call; mla_decode's at full fp32
precision) is recorded beside.  router_topk is timed at every preset (only_where_faster=False).

--kda-sweep adds kda_decode's value blocks and warps (`KDA_SWEEP`) at every preset beside the default's row.
--mla-sweep adds mla_decode tilings (`MLA_SWEEP`: head group, slot block, split, warps, stages) at
K3 TP 1 (B 1 and 8) and TP 8 (B 1), beside the default tiling's row, to pick the default from.

    python scripts/gpu/kernels_real.py [--json PATH] [--kernels a,b] [--batches 1,8] [--mla-sweep] [--kda-sweep]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import test_kernels_real as T  # noqa: E402

from jaxk3 import kernels  # noqa: E402

CHAIN, INNER, REPS = 20, 3, 9
# mla_decode tilings for --mla-sweep: (block_h, block_s, split (None: `tiles` picks), num_warps, num_stages)
MLA_SWEEP = [
    (16, 32, 128, 4, 2), (16, 32, 256, 4, 2),  # fewer, longer parts: fewer partial sums to write and merge
    (16, 64, None, 4, 2), (16, 16, None, 4, 2),  # the slot block (the dots' N, and K of p·c_kv)
    (16, 32, None, 4, 3), (16, 32, None, 8, 2),  # deeper pipelining, more warps
    (32, 32, None, 4, 2), (64, 32, None, 8, 2), (64, 64, None, 8, 2),  # larger head groups: the cache read fewer times
]
MLA_SWEEP_AT = [("k3", 1, 1), ("k3", 1, 8), ("k3", 8, 1)]
# kda_decode for --kda-sweep: (value columns per program, warps); bv 128 = one program per head (the kernel before
# the split, its gated norm now after it)
KDA_SWEEP = [(128, 4), (128, 8), (64, 4), (32, 4), (16, 4), (32, 2)]


def chained(name: str, fn, args, kw):
    """(jitted f, its array arguments): CHAIN dependent calls of fn in a fori_loop."""
    if name == "rms_norm":
        x, w, eps = args
        return jax.jit(lambda x, w: jax.lax.fori_loop(0, CHAIN, lambda _, x: fn(x, w, eps).astype(x.dtype), x)), (x, w)
    if name == "kda_decode":
        cfg, u, conv, cw, f, beta, z, state, valid = args

        def run(u, conv, cw, f, beta, z, state, valid):
            def body(_, c):  # the output feeds the next token's projections
                o, conv2, state2 = fn(cfg, c[0], c[1], cw, f, beta, z, c[2], valid, **kw)
                return (c[0].astype(jnp.float32) + 1e-6 * o[:, None, :]).astype(c[0].dtype), conv2, state2
            return jax.lax.fori_loop(0, CHAIN, body, (u, conv, state))
        return jax.jit(run), (u, conv, cw, f, beta, z, state, valid)
    if name == "router_topk":
        cfg, logits, bias = args
        def step(lg, b):
            w, ids = fn(cfg, lg, b)
            return lg + 1e-6 * w[:, :1] + 1e-9 * ids[:, :1].astype(lg.dtype)
        return jax.jit(lambda lg, b: jax.lax.fori_loop(0, CHAIN, lambda _, lg: step(lg, b), lg)), (logits, bias)
    if name == "mla_decode":
        ql, qpe, kv, length, scale = args
        return jax.jit(lambda ql, qpe, kv, length: jax.lax.fori_loop(
            0, CHAIN, lambda _, q: fn(q, qpe, kv, length, scale, **kw), ql)), (ql, qpe, kv, length)
    if name == "moe_experts":
        cfg, w, z, wk, ids, shared = args
        return jax.jit(lambda w, z, wk, ids, shared: jax.lax.fori_loop(
            0, CHAIN, lambda _, z: fn(cfg, w, z, wk, ids, shared, **kw).astype(z.dtype), z)), (w, z, wk, ids, shared)
    if name == "moe_grouped":
        cfg, w, z, wk, ids = args
        return jax.jit(lambda w, z, wk, ids: jax.lax.fori_loop(
            0, CHAIN, lambda _, z: fn(cfg, w, z, wk, ids).astype(z.dtype), z)), (w, z, wk, ids)
    raise KeyError(name)


def timed(c, args) -> float:
    return timing.per_call(c, args, reps=REPS, inner=INNER, chain=CHAIN)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "kernels_real.json"))
    ap.add_argument("--kernels", default="")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--mla-sweep", action="store_true", help="also the mla_decode tilings of MLA_SWEEP at K3 TP 1/8")
    ap.add_argument("--kda-sweep", action="store_true", help="also the kda_decode tilings of KDA_SWEEP at each preset")
    a = ap.parse_args(argv)
    cpu = jax.devices()[0].platform == "cpu"
    global CHAIN, INNER, REPS
    if cpu:  # interpret mode: plumbing only
        CHAIN, INNER, REPS = 1, 1, 1
    log = timing.logger(a.json)
    dev = jax.devices()[0]
    log(f"# kernels at real dims on {dev.platform} {dev.device_kind}, jax {jax.__version__}, chain {CHAIN}")
    want = set(a.kernels.split(",")) if a.kernels else None
    jobs = []  # (label, kernel, preset, tp, B, path, kw)
    for kernel, preset, tp in T.CASES:
        if want and kernel not in want:
            continue
        for B in map(int, a.batches.split(",")):
            for path in ("xla", "kernel"):
                jobs.append((kernel, preset, tp, B, path, {}))
    if a.kda_sweep:
        from jaxk3.kernels.kda_decode import Config as KC

        for kernel, preset, tp in T.CASES:
            if kernel == "kda_decode" and (not want or kernel in want):
                for B in map(int, a.batches.split(",")):
                    for bv, nw in KDA_SWEEP:
                        jobs.append((kernel, preset, tp, B, f"kernel bv{bv} w{nw}", dict(config=KC(bv=bv, num_warps=nw))))
    if a.mla_sweep:
        for preset, tp, B in MLA_SWEEP_AT:
            for bh, bs, sp, nw, ns in MLA_SWEEP:
                kw = dict(block_h=bh, block_s=bs, split=sp, num_warps=nw, num_stages=ns)
                jobs.append(("mla_decode", preset, tp, B, f"kernel h{bh} s{bs} sp{sp} w{nw} st{ns}", kw))
    built = {}

    def prep(job):
        kernel, preset, tp, B, path, kw = job
        name, fmt = T.split(kernel)
        try:
            key = (kernel, preset, tp, B)
            if key not in built:
                built[key] = T.case(name, preset, tp, B, fmt=fmt)
            args, ckw = built[key]
            if path != "xla":
                why = kernels.REGISTRY[name].fits(*args, **{**ckw, **kw})
                if why:
                    return job, None, None, f"does not fit: {why}"
                fn = lambda *x, **k: kernels.REGISTRY[name].device(*x, interpret=cpu, **k)  # noqa: E731
            else:
                fn = kernels.REGISTRY[name].reference
            f, fargs = chained(name, fn, args, kw)
            return job, f.lower(*fargs).compile(), fargs, None
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            i = msg.find("shared memory")
            return job, None, None, f"{type(e).__name__}: " + (msg[max(0, i - 200):i + 200] if i >= 0 else msg[:400])
    # build the arrays serially (the RNG), compile in parallel
    for j in jobs:
        name, fmt = T.split(j[0])
        key = (j[0], j[1], j[2], j[3])
        if key not in built:
            built[key] = T.case(name, j[1], j[2], j[3], fmt=fmt)
    pool = cf.ThreadPoolExecutor(max_workers=max(2, min(12, (os.cpu_count() or 2) - 2)))
    t0 = time.time()
    import signal

    def stop(*_):
        raise SystemExit("SIGTERM")
    signal.signal(signal.SIGTERM, stop)
    rows, xla_us = [], {}
    try:
        # every compile first, then the timings: a timing beside running compiles (threads holding the CPU and the GIL)
        # is delayed by them (scripts/gpu/mla_sweep.py measured one tiling from 26 to 540 us that way, 2026-12-03)
        compiled = list(pool.map(prep, jobs))
        log(f"# {len(compiled)} compiled in {time.time() - t0:.0f} s")
        loop(compiled, rows, xla_us, built, kw_log=log, cpu=cpu)
    except SystemExit as e:
        log(f"# stopped early: {e}")
        pool.shutdown(wait=False, cancel_futures=True)
    log(f"# {len(rows)} of {len(jobs)} jobs in {time.time() - t0:.0f} s")
    summary(a, dev, rows, xla_us, log)
    sys.stdout.flush()
    os._exit(0)  # compiles still running in the pool's threads are not waited for


def loop(compiled, rows, xla_us, built, kw_log, cpu):
    log = kw_log
    for job, c, fargs, err in compiled:
        kernel, preset, tp, B, path, kw = job
        label = f"{kernel:<18} {preset:<16} tp{tp} B{B} {path:<16}"
        if c is None:
            log(f"{label} FAILED {err}")
            rows.append(dict(kernel=kernel, preset=preset, tp=tp, B=B, path=path, error=err))
            continue
        try:
            us = timed(c, fargs) * 1e6
        except Exception as e:  # noqa: BLE001
            log(f"{label} RUN FAILED {type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(kernel=kernel, preset=preset, tp=tp, B=B, path=path, error=str(e)[:300]))
            continue
        rel = None
        if path != "xla":
            name, _ = T.split(kernel)
            args, _ = built[(kernel, preset, tp, B)]
            try:
                ref = T.reference(name, args)  # mla_decode: at full fp32 precision (not TF32)
                f1, dyn = T.bind(lambda *x: kernels.REGISTRY[name].device(*x, interpret=cpu, **kw), args)
                got = f1(*dyn)
                rel = T.compare(name, got, ref)
            except Exception as e:  # noqa: BLE001
                rel = f"{type(e).__name__}: {str(e)[:200]}"
        else:
            xla_us[(kernel, preset, tp, B)] = us
        base = xla_us.get((kernel, preset, tp, B))
        ratio = base / us if base and path != "xla" else None
        rows.append(dict(kernel=kernel, preset=preset, tp=tp, B=B, path=path, us=us, x_vs_xla=ratio, err=rel))
        log(f"{label} {us:9.1f} us" + (f"  x{ratio:5.2f} vs xla" if ratio else "") +
            (f"  err {rel:.1e}" if isinstance(rel, float) else (f"  err {rel}" if rel else "")))


def summary(a, dev, rows, xla_us, log):
    with open(a.json, "w") as f:
        json.dump(dict(device=f"{dev.platform} {dev.device_kind}", jax=jax.__version__, rows=rows), f, indent=1)
    log("\n# kernels vs XLA at real dims (us per call; x > 1: the kernel is faster)")
    log(f"{'kernel':<18} {'preset':<16} {'tp':>2} {'B':>2} {'xla us':>8} {'kern us':>8} {'x':>6}  err")
    for r in rows:
        if r["path"] == "xla":
            continue
        base = xla_us.get((r["kernel"], r["preset"], r["tp"], r["B"]))
        if "us" in r:
            err = r["err"] if isinstance(r["err"], float) else float("nan")
            log(f"{r['kernel']:<18} {r['preset']:<16} {r['tp']:>2} {r['B']:>2} {base or float('nan'):>8.1f} "
                f"{r['us']:>8.1f} {r['x_vs_xla'] or float('nan'):>6.2f}  {err:.1e} {r['path'] if r['path'] != 'kernel' else ''}")
        else:
            log(f"{r['kernel']:<18} {r['preset']:<16} {r['tp']:>2} {r['B']:>2} {base or float('nan'):>8.1f} "
                f"{'-':>8} {'-':>6}  {r['path']} {r['error'][:120]}")


if __name__ == "__main__":
    sys.exit(main())
