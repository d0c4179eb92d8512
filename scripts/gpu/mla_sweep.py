"""The MLA decode attention as the Kimi-Linear-48B step runs it (`mla_decode_uv`: the attention kernel's parts, then
one kernel merging them and applying W_UV) in its tilings, against XLA's path (`uv_reference`: the attention as
jnp, then the W_UV einsum) and the two-kernel path (`mla_decode` and its jnp merge, then the einsum), at the 48B's
MLA dims (32 heads, latent 512 + 64, W_UV 128 of each head's 256 rows) and 4K and 32K cache slots, in one run.

Per (context, B): one jit per path holding a fori_loop of CHAIN dependent calls (the output nudges the next query),
the median per call over REPS, and the output's error against the reference at full fp32 precision (max |a - b| /
max |b|, against tests/test_kernels.py's MLA_TOL = 1e-2).  The tilings (`variants`): the context split (slots per
grid program: parts = context / split), the attention grid's order (`gp` a head group's parts together, `pg` a part's
head groups together), and the merge loop's parts per step and pipelining.  The default's row is marked.

    python scripts/gpu/mla_sweep.py [--contexts 4096,32768] [--batches 1,8] [--json out/mla_sweep.json]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

from jaxk3.kernels import mla_decode as MD  # noqa: E402
from jaxk3.tools.bench_decode import load_config  # noqa: E402

CHAIN, INNER, REPS = 20, 3, 9
SCALE = 0.07
CPU = jax.devices()[0].platform == "cpu"  # interpret mode, one call per timing: the script's plumbing only
if CPU:
    CHAIN, INNER, REPS = 1, 1, 1


def case(B: int, S: int, seed: int = 0):
    """(ql, qpe, kv, length, wkvb, v0) at the 48B's MLA dims; B = 1 the whole cache, B > 1 ragged lengths."""
    cfg = load_config("kimi-linear-48b")
    H, R, P, n, v = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                     cfg.v_head_dim)
    k = iter(jax.random.split(jax.random.key(seed + B + S), 8))
    ql = jax.random.normal(next(k), (B, H, R), jnp.float32)
    qpe = jax.random.normal(next(k), (B, H, P), jnp.float32)
    kv = jax.random.normal(next(k), (B, S, R + P), jnp.float32).astype(jnp.bfloat16)
    frac = np.array([1.0, 0.19, 0.5, 0.001, 0.98, 0.0, 0.73, 0.3])[:B] if B > 1 else np.array([1.0])
    length = jnp.asarray(np.minimum((frac * S).astype(int), S - 1), jnp.int32)
    wkvb = (jax.random.normal(next(k), (H, n + v, R), jnp.float32) * R ** -0.5).astype(jnp.bfloat16)
    return ql, qpe, kv, length, wkvb, n


def variants(S: int, B: int, only: str | None = None) -> list[tuple[str, dict]]:
    """(label, mla_decode_uv kwargs): the default, then split x order x merge steps x merge pipelining; `only`
    "merge" (--merge): the default tiles' value-row merge against the R-split merge (mla_decode.MERGE_R), twice each,
    in turn; "heads" (--heads): 32 heads a program (one head group: the cache read once) by split against the default."""
    out = [("uv default", {})]
    if only == "heads":
        splits = [sp for sp in (64, 128, 256, 512, 1024) if sp <= S // 4 and S // sp <= 512]
        for rep in ("", " again"):
            out += [(f"uv 32 heads split {sp}{rep}", dict(block_h=32, split=sp)) for sp in splits]
            out.append((f"uv default{rep} (16 heads)", {}))
        return out
    if only == "merge":
        for rep in ("", " again"):
            out += [(f"uv merge_r 128{rep}", dict(merge_r=128)), (f"uv merge_r 64{rep}", dict(merge_r=64)),
                    (f"uv value rows{rep}", dict(merge_r=0))]
        return out
    splits = [s for s in (64, 128, 256, 512, 1024, 2048) if s <= S // 4 and S // s <= 256]
    if B > 1:
        splits = [s for s in splits if s >= 256]
    for sp, order, st, pc in itertools.product(splits, ("gp", "pg"), (1, 2, 3) if B == 1 else (1, 2), (8, 16)):
        out.append((f"uv split {sp} {order} merge st{st} pc{pc}",  # the value-row merge these settings are for
                    dict(split=sp, order=order, merge_stages=st, merge_pc=pc, merge_r=0)))
    return out


def chained(fn, args):
    ql, qpe, kv, length, wkvb, v0 = args

    def run(ql, qpe, kv, length, wkvb):
        def body(_, q):
            o = fn(q, qpe, kv, length, SCALE, wkvb, v0)
            return q + 1e-6 * jnp.mean(o)
        return jax.lax.fori_loop(0, CHAIN, body, ql)
    return jax.jit(run), (ql, qpe, kv, length, wkvb)


def paths(S: int, B: int, only: str | None = None):
    """(label, fn(ql, qpe, kv, length, scale, wkvb, v0) -> [B, H, V] fp32, kwargs checked by uv_fits or None)."""
    out = [("xla (uv_reference)", MD.uv_reference, None),
           ("mla_decode + jnp merge + einsum",
            lambda q, p, kv, ln, sc, w, v0: jnp.einsum("bhr,hvr->bhv", MD.mla_decode(q, p, kv, ln, sc, interpret=CPU),
                                                       w[:, v0:].astype(jnp.float32)), {})]
    for label, kw in variants(S, B, only):
        out.append((label, lambda *a, kw=kw: MD.mla_decode_uv(*a, interpret=CPU, **kw), kw))
    if CPU:  # interpret mode (plumbing only): the default, and one variant per order
        out = out[:3] + [p for p in out if p[0].startswith("uv split") and "st1 pc8" in p[0]][:2]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "out"), "mla_sweep.json"))
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--merge", action="store_true", help="only the merge's two forms (value rows, R split)")
    ap.add_argument("--heads", action="store_true", help="only 32 heads a program (the cache read once) by split")
    a = ap.parse_args(argv)
    if a.merge and a.heads:
        ap.error("--merge and --heads: give one of them")
    only = "merge" if a.merge else "heads" if a.heads else None
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    log = timing.logger(a.json)
    dev = jax.devices()[0]
    log(f"# mla_decode_uv tilings at Kimi-Linear-48B's MLA on {dev.platform} {dev.device_kind}, jax {jax.__version__}; "
        f"defaults: split rule tiles(), order {MD.ORDER}, merge pc {MD.MERGE_PC} stages {MD.MERGE_STAGES}")
    jobs, cases = [], {}
    for S in map(int, a.contexts.split(",")):
        for B in map(int, a.batches.split(",")):
            cases[(S, B)] = case(B, S)
            Hb, bs, sp = MD.tiles(B, 32, S, 512, 64)
            log(f"# S {S} B {B}: the default tiles (Hb, bs, split) = {(Hb, bs, sp)}: {S // sp} parts")
            for label, fn, kw in paths(S, B, only):
                jobs.append((S, B, label, fn, kw))

    def prep(job):
        S, B, label, fn, kw = job
        args = cases[(S, B)]
        if kw is not None:
            why = MD.uv_fits(*args[:4], SCALE, *args[4:], only_where_faster=False, **kw)
            if why:
                return job, None, None, f"does not fit: {why}"
        try:
            f, fargs = chained(fn, args)
            one = jax.jit(lambda *x, v0=args[5]: fn(*x[:4], SCALE, x[4], v0)).lower(*args[:5]).compile()
            return job, (f.lower(*fargs).compile(), one), fargs, None
        except Exception as e:  # noqa: BLE001
            return job, None, None, f"{type(e).__name__}: {str(e)[:300]}"
    refs = {}
    for key, args in cases.items():
        with jax.default_matmul_precision("highest"):
            refs[key] = np.asarray(jax.jit(lambda *x, v0=args[5]: MD.uv_reference(*x[:4], SCALE, x[4], v0))(
                *args[:5]))
    pool = cf.ThreadPoolExecutor(max_workers=max(2, min(12, (os.cpu_count() or 2) - 2)))
    t0, rows = time.time(), []
    import signal

    def stop(*_):
        raise SystemExit("SIGTERM")
    signal.signal(signal.SIGTERM, stop)
    try:
        # every compile first, then the timings: compiles running beside a timing (threads holding the CPU and the GIL)
        # delay its dispatches, which measured the same tiling from 26 to 540 us (2026-12-03, call 1)
        compiled = list(pool.map(prep, jobs))
        log(f"# {len(compiled)} compiled in {time.time() - t0:.0f} s")
        timed_rows(compiled, cases, refs, rows, log)
    except SystemExit as e:
        log(f"# stopped early: {e}")
    log(f"# {len(rows)} rows in {time.time() - t0:.0f} s")
    summary(a, dev, cases, rows, log)
    sys.stdout.flush()
    os._exit(0)


def timed_rows(compiled, cases, refs, rows, log):
    for job, c, fargs, err in compiled:
        S, B, label, fn, kw = job
        head = f"S {S:5d} B {B} {label:<40}"
        if c is None:
            log(f"{head} {err}")
            rows.append(dict(S=S, B=B, path=label, error=err))
            continue
        us = timing.per_call(c[0], fargs, reps=REPS, inner=INNER, chain=CHAIN) * 1e6
        got = np.asarray(c[1](*cases[(S, B)][:5]))
        ref = refs[(S, B)]
        rel = float(np.abs(got - ref).max() / np.abs(ref).max()) if np.isfinite(got).all() else float("nan")
        rows.append(dict(S=S, B=B, path=label, us=us, rel_err=rel, kw=kw))
        log(f"{head} {us:8.1f} us  err {rel:.1e}")


def summary(a, dev, cases, rows, log):
    log("\n# per (S, B): XLA, the two-kernel path, the default, the five fastest (x: XLA's us / this)")
    for S, B in cases:
        got = [r for r in rows if r["S"] == S and r["B"] == B and "us" in r]
        xla = next((r["us"] for r in got if r["path"].startswith("xla")), float("nan"))
        fixed = [r for r in got if not r["path"].startswith("uv split")]
        best = sorted((r for r in got if r["path"].startswith("uv split")), key=lambda r: r["us"])[:5]
        for r in fixed + best:
            log(f"S {S:5d} B {B} {r['path']:<40} {r['us']:8.1f} us  x{xla / r['us']:5.2f}  err {r['rel_err']:.1e}")
    with open(a.json, "w") as fh:
        json.dump(dict(device=f"{dev.platform} {dev.device_kind}", jax=jax.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
