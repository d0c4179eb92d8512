"""The prefill MoE at Kimi-Linear-48B dimensions on one GPU (hidden 2304, expert intermediate 1024,
256 experts, top-8): the grouped-GEMM kernel (jaxk3.kernels.moe_grouped) against the forms it would
replace, in the same run, at N prompt tokens per chunk:

  dense    experts_dense: batched GEMMs over every local expert (today's prefill path; E/k x the FLOPs)
  ragged   experts_grouped: lax.ragged_dot_general over the pairs sorted by expert (exact FLOPs)
  kernel   the two Pallas kernels, default config (config_for) and the configs of SWEEP
  gemm     one plain bf16 GEMM of the same exact FLOPs ([N·k, L] x [L, 3I]): the attainable peak

Per row: ms per call (median of REPS x INNER calls), exact TFLOP/s (6·N·k·L·I / t), and the relative
error against `ragged` (max |a - b| / max |b|).  Routing is uniform at random (the expected load).

    python scripts/gpu/moe_grouped.py [--json PATH] [--tokens 512,4096] [--experts 256] [--no-sweep]
    python scripts/gpu/moe_grouped.py --align [--tokens 4096]   # only `align` against the sort it replaced, same
                                                                # run, then the kernel path's phases (a short call)
    python scripts/gpu/moe_grouped.py --tokens 4096 --mosaic --no-dense   # the Mosaic GPU form (MOSAIC) against
                                                # the Triton default, errors against the latter, then both's phases
    python scripts/gpu/moe_grouped.py --tokens 4096 --split --no-dense    # the split tiling (config_for's at 128 rows
                                                # an expert) and bm 64 (SPLIT), the default before and after
    python scripts/gpu/moe_grouped.py --tokens 512,4096 --mask --no-dense --no-phases  # config_for's choice against
                                                # MASK off, each layer's kernels from a profile
    python scripts/gpu/moe_grouped.py --tokens 4096 --down --no-dense --no-phases  # kernel 2's tilings and the
                                                # masked padding (DOWN; DOWN2=1: DOWN2), each layer's kernels
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

from jaxk3.kernels import moe_grouped as G  # noqa: E402
from jaxk3.layers import moe  # noqa: E402
from jaxk3.tools.bench_decode import load_config  # noqa: E402

INNER, REPS = 3, 5
SWEEP = [G.Config(bm=bm, bn=bn, bk=bk, num_warps=w, num_stages=s, order=o)
         for bm, bn, bk, w, s, o in [(64, 128, 64, 4, 3, "m"), (64, 128, 64, 4, 4, "n"), (128, 128, 64, 8, 4, "n"),
                                     (64, 128, 64, 8, 4, "n"), (128, 128, 64, 8, 3, "n"), (64, 256, 64, 8, 3, "n"),
                                     (16, 128, 64, 4, 3, "n")]] + [
    # the rows sorted into a copy first, as before the eleventh session (Config.gather is on by default)
    G.Config(bm=64, bn=128, bk=64, num_warps=4, num_stages=4, order="n", gather=False),
    G.Config(bm=128, bn=128, bk=64, num_warps=8, num_stages=3, order="n", gather=False)]
# `--split` (thirty-fourth session): the split (gate|up on 128-row blocks on 8 warps, down on their 64-row halves on 4:
# config_for's choice from 128 rows an expert since then) against the bm 64 tiling it replaced there and bm 128 alone,
# the default again after them
SPLIT = [G.Config(bm=64, bn=128, bk=64, num_warps=4, num_stages=4, order="n"),
         G.Config(bm=128, bn=128, bk=64, num_warps=8, num_stages=4, order="n"),
         G.Config(bm=128, bn=128, bk=64, num_warps=8, num_stages=4, order="n", down_bm=64, down_warps=4),
         G.Config(bm=128, bn=128, bk=64, num_warps=8, num_stages=3, order="n", down_bm=64, down_warps=4)]
# `--down` (fortieth session): kernel 2's own tilings beside the split (down_bn, down_stages, down_warps; on the
# layout's whole 128-row blocks with the padding rows masked, or on their 64-row halves) and the padding masked
# (`mask`) in both kernels, the default again after them; each layer's device kernels from a profile
_S = G.Config(bm=128, bn=128, bk=64, num_warps=8, num_stages=4, order="n", down_bm=64, down_warps=4)
DOWN = [dataclasses.replace(_S, **kw) for kw in (
    dict(mask=True),
    dict(down_bn=256, down_warps=8, down_stages=4, mask=True),
    dict(down_bm=0, down_warps=8, down_stages=3, mask=True),
    dict(down_bm=0, down_warps=8, down_bn=256, down_stages=3, mask=True),
)]
# call 2: kernel 2 on the whole blocks, masked, around call 1's best
DOWN2 = [dataclasses.replace(_S, down_bm=0, mask=True, **kw) for kw in (
    dict(down_warps=8, down_stages=3), dict(down_warps=8, down_stages=4), dict(down_warps=8, down_stages=2),
    dict(down_warps=8, down_bn=256, down_stages=2), dict(down_warps=4, down_bn=64, down_stages=4),
    dict(down_warps=4, down_stages=3))]
# the Mosaic GPU form (jaxk3.kernels.moe_grouped_mgpu: TMA, wgmma, a persistent grid): pipeline depth and snake width
MOSAIC = [G.Config(bm=64, bn=128, bk=64, num_stages=s, backend="mosaic", width=wd)
          for s, wd in ((4, 4), (3, 4), (5, 4), (4, 1), (4, 8))] + [
    G.Config(bm=128, bn=64, bk=64, num_stages=4, backend="mosaic", width=4)] + [
    G.Config(bm=bm, bn=bn, bk=64, num_stages=s, backend="mosaic_ws", width=4)
    for bm, bn, s in ((64, 128, 4), (64, 256, 4), (128, 128, 4), (64, 128, 6))]


def phases(kcfg, w, z, wk, ids, c, log, N):
    """Each step of the kernel path alone (ms): align + the input gather, gate-up, down, the combine."""
    E, I, L = G._shapes(w)
    # the weights are arguments, not constants closed over (2.4 GB of them made each compile take minutes)
    prep = jax.jit(lambda w, z, ids: G.prepare(w, z, ids, c))
    pos, expert, src, xs = prep(w, z, ids)
    gu = jax.jit(lambda w, e, s, x: G.gate_up(kcfg, w, e, s, x, c, num_tokens=N))
    a = gu(w, expert, src, xs)
    expert_d, c_d = G.down_blocks(expert, src, N, c)  # kernel 2's blocks (`down_bm`: sub-blocks of the layout's)
    dn = jax.jit(lambda w, e, a, s: G.down(w, e, a, c_d, src_M=s, num_tokens=N))
    y = dn(w, expert_d, a, src)
    cb = jax.jit(G.combine)
    out = {}
    for name, f, args in (("prepare", prep, (w, z, ids)), ("gate_up", gu, (w, expert, src, xs)),
                          ("down", dn, (w, expert_d, a, src)), ("combine", cb, (y, pos, wk))):
        out[name] = timing.per_call(f, args, reps=REPS, inner=INNER, chain=1) * 1e3
    k = kcfg.num_experts_per_token
    used = int(np.sum(np.asarray(expert) >= 0))
    log(f"N {N:5d} phases of {c}: " + "  ".join(f"{n} {t:.3f} ms" for n, t in out.items())
        + f"  (blocks used {used} of {expert.shape[0]}; gate_up {4 * N * k * L * I / out['gate_up'] / 1e9:.1f}, "
        f"down {2 * N * k * L * I / out['down'] / 1e9:.1f} TFLOP/s exact)")
    return out


def case(cfg, E: int, N: int, seed: int = 0):
    k, I, L = cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.moe_hidden
    keys = jax.random.split(jax.random.key(seed), 4)
    w = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=None, experts_w3=None,
                       experts_w2=(0.02 * jax.random.normal(keys[0], (E, L, I), jnp.float32)).astype(jnp.bfloat16),
                       experts_w13=(0.02 * jax.random.normal(keys[1], (E, 2 * I, L), jnp.float32)).astype(jnp.bfloat16))
    z = jax.random.normal(keys[2], (N, L), jnp.float32).astype(jnp.bfloat16)
    r = np.random.default_rng(seed)
    ids = jnp.asarray(np.stack([r.permutation(E)[:k] for _ in range(N)]), jnp.int32)
    wk = jnp.asarray(r.uniform(0.05, 0.3, (N, k)), jnp.float32)
    return dataclasses.replace(cfg, num_experts=E), w, z, wk, ids


def align_sorted(ids_Nk, num_experts: int, bm: int):
    """The layout as `G.align` made it before the eleventh session: a stable argsort of the pairs by expert and two
    scatters (the baseline of --align; the same pos, src and expert)."""
    N, k = ids_Nk.shape
    P, E = N * k, num_experts
    nb = G.num_blocks(P, E, bm)
    flat = ids_Nk.reshape(-1).astype(jnp.int32)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    first_row, expert = G.blocks_of(sizes, bm, nb)  # shared with G.align: only the rank's computation differs
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    e_sorted = flat[order]
    rank = jnp.arange(P, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[e_sorted]
    pos = jnp.zeros((P,), jnp.int32).at[order].set(first_row[e_sorted] + rank)
    src = jnp.full((nb * bm,), N, jnp.int32).at[pos].set(jnp.arange(P, dtype=jnp.int32) // k)
    return pos.reshape(N, k), src, expert


def align_rows(a, log) -> list[dict]:
    """--align: `G.align` against `align_sorted` (ms per call, same run; their outputs must be equal), then the
    kernel path at its default config and its phases."""
    cfg, rows = load_config("kimi-linear-48b"), []
    for N in (int(t) for t in a.tokens.split(",")):
        kcfg, w, z, wk, ids = case(cfg, a.experts, N)
        k, I, L = kcfg.num_experts_per_token, kcfg.moe_intermediate_size, kcfg.moe_hidden
        c = G.config_for(N * k, a.experts, I, L)
        new, old = (jax.jit(lambda ids, f=f: f(ids, a.experts, c.bm)) for f in (G.align, align_sorted))
        same = all(bool(jnp.array_equal(x, y)) for x, y in zip(new(ids), old(ids)))
        t_new, t_old = (timing.per_call(f, (ids,), reps=REPS, inner=INNER, chain=1) * 1e3 for f in (new, old))
        log(f"N {N:5d} align (bm {c.bm}): {t_new:.3f} ms against the sort's {t_old:.3f} ({t_old / t_new:.2f}x); "
            f"the same layout: {same}")
        search0, by_search = G.SEARCH, {}
        for search in ("scan", search0, "scan", search0):  # blocks_of's search before the fifteenth session, and now
            G.SEARCH = search  # read when the calls are traced
            full = jax.jit(lambda w, z, wk, ids: G.grouped(kcfg, w, z, wk, ids))
            prep = jax.jit(lambda w, z, ids: G.prepare(w, z, ids, c))
            t = timing.per_call(full, (w, z, wk, ids), reps=REPS, inner=INNER, chain=1)
            tp = timing.per_call(prep, (w, z, ids), reps=REPS, inner=INNER, chain=1)
            by_search.setdefault(search, []).append(dict(layer_ms=t * 1e3, prepare_ms=tp * 1e3))
            log(f"N {N:5d} kernel default {c}, search {search}: {t * 1e3:.3f} ms  "
                f"{6.0 * N * k * L * I / t / 1e12:.1f} TFLOP/s exact; its prepare {tp * 1e3:.3f} ms")
        G.SEARCH = search0
        rows.append(dict(tokens=N, align_ms=t_new, sorted_ms=t_old, same=same, kernel_ms=t * 1e3, by_search=by_search,
                         prepare_kernels=device_ops(prep, (w, z, ids), log, f"N {N:5d} prepare"),
                         phases_ms=phases(kcfg, w, z, wk, ids, c, log, N)))
    return rows


def device_ops(f, args, log, head: str, calls: int = 5, top: int = 12, hlo: bool = True) -> list:
    """The device kernels of the compiled `f` from a profile of `calls` calls: [op, us per call, launches per call],
    slowest first (where a small XLA program's time goes), each logged with the start of its HLO line (`hlo`: which
    compiles f once more)."""
    import tempfile

    from jaxk3.tools.census import _event_op, find_xplane

    jax.block_until_ready(f(*args))
    d = tempfile.mkdtemp(prefix="jaxk3_prof_")
    with jax.profiler.trace(d):
        for _ in range(calls):
            jax.block_until_ready(f(*args))
    from jax.profiler import ProfileData

    ns, n = {}, {}
    for plane in ProfileData.from_file(find_xplane(d)).planes:
        if not plane.name.startswith("/device:") or "CPU" in plane.name:
            continue
        for line in plane.lines:
            for ev in line.events:
                op = _event_op(ev.name, dict(ev.stats))[0] or ev.name
                ns[op] = ns.get(op, 0) + ev.duration_ns
                n[op] = n.get(op, 0) + 1
    hlo = {ln.split("=")[0].strip().lstrip("%").replace("ROOT ", ""): ln.strip()
           for ln in f.lower(*args).compile().as_text().splitlines() if " = " in ln} if hlo else {}
    rows = sorted(([op, ns[op] / calls / 1e3, n[op] / calls] for op in ns), key=lambda r: -r[1])
    log(f"{head}: {sum(r[1] for r in rows):.1f} us of device events per call in {sum(r[2] for r in rows):.0f} "
        "launches; the slowest:")
    for op, us, k in rows[:top]:
        log(f"  {us:8.1f} us  x{k:4.1f}  {op[:40]:40s} {hlo.get(op, '')[:150]}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="out/moe_grouped.json")
    ap.add_argument("--tokens", default="512,4096,8192")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--align", action="store_true", help="only align against the sort it replaced, then the phases")
    ap.add_argument("--mosaic", action="store_true", help="the Mosaic GPU configs (MOSAIC) instead of SWEEP, and the "
                    "phases of the best of them")
    ap.add_argument("--split", action="store_true", help="the SPLIT configs (bm 64; gate|up on 128 rows, down on 64) "
                    "instead of SWEEP, then the default again")
    ap.add_argument("--down", action="store_true", help="kernel 2's tilings and the masked padding (DOWN) instead of "
                    "SWEEP, then the default again, each layer's device kernels from a profile")
    ap.add_argument("--mask", action="store_true", help="config_for's choice against its choice with MASK off (the "
                    "form before the fortieth session), the default again")
    ap.add_argument("--no-phases", action="store_true", help="leave out the default's and the best's phases")
    ap.add_argument("--no-dense", action="store_true", help="leave out the dense and ragged forms (minutes to compile)")
    a = ap.parse_args(argv)
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    log = timing.logger(a.json)
    cfg = load_config("kimi-linear-48b")
    rows = []
    log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; Kimi-Linear-48B MoE dims, {a.experts} experts")
    if a.align:
        rows = align_rows(a, log)
        write(a, rows)
        return 0 if all(r["same"] for r in rows) else 1
    for N in (int(t) for t in a.tokens.split(",")):
        kcfg, w, z, wk, ids = case(cfg, a.experts, N)
        k, I, L = kcfg.num_experts_per_token, kcfg.moe_intermediate_size, kcfg.moe_hidden
        flops = 6.0 * N * k * L * I
        ref = jax.jit(lambda w, z, wk, ids: G.experts_grouped(kcfg, w, z, wk, ids))
        # the errors against the ragged_dot form; with --no-dense against the default kernel (proven against it)
        want = np.asarray((jax.jit(lambda w, z, wk, ids: G.grouped(kcfg, w, z, wk, ids)) if a.no_dense else ref)(
            w, z, wk, ids))
        xg = jax.random.normal(jax.random.key(9), (N * k, L), jnp.float32).astype(jnp.bfloat16)
        wg = (0.02 * jax.random.normal(jax.random.key(8), (L, 3 * I), jnp.float32)).astype(jnp.bfloat16)
        paths = [("gemm", jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)), (xg, wg))]
        if not a.no_dense:
            paths += [("dense", jax.jit(lambda w, z, wk, ids: G.experts_dense(kcfg, w, z, wk, ids)), (w, z, wk, ids)),
                      ] + ([("ragged", ref, (w, z, wk, ids))] if N <= 4096 else [])
        configs = [("kernel default " + str(G.config_for(N * k, a.experts, I, L)), None)]
        if a.mosaic:
            configs += [(f"kernel {c}", c) for c in MOSAIC]
        elif a.split:
            configs += [(f"kernel {c}", c) for c in SPLIT] + [("kernel default again", None)]
        elif a.mask:  # config_for's choice before the fortieth session (MASK off), then the default again
            G.MASK = False
            old = G.config_for(N * k, a.experts, I, L)
            G.MASK = True
            configs += [(f"kernel MASK off {old}", old), ("kernel default again", None)]
        elif a.down:
            configs += [(f"kernel {c}", c) for c in (DOWN2 if os.environ.get("DOWN2") else DOWN)] + [
                ("kernel default again", None)]
        elif not a.no_sweep:
            configs += [(f"kernel {c}", c) for c in SWEEP]
        for name, c in configs:
            why = G.fits(kcfg, w, z, wk, ids, config=c)
            if why:
                log(f"N {N:5d} {name}: skipped ({why})")
                continue
            paths.append((name, jax.jit(lambda w, z, wk, ids, c=c: G.grouped(kcfg, w, z, wk, ids, config=c)),
                          (w, z, wk, ids)))
        best = None
        base = None
        for name, f, args in paths:
            try:
                t = timing.per_call(f, args, reps=REPS, inner=INNER, chain=1)
                err = None if name == "gemm" else float(np.max(np.abs(np.asarray(f(*args)) - want)) /
                                                         np.max(np.abs(want)))
            except Exception as e:  # a config that does not compile is a row, not the end of the run
                log(f"N {N:5d} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                rows.append(dict(tokens=N, path=name, error=str(e)[:2000]))
                continue
            base = t if name == ("dense" if not a.no_dense else configs[0][0]) else base
            log(f"N {N:5d} {name:70s} {t * 1e3:8.3f} ms  {flops / t / 1e12:7.1f} TFLOP/s exact"
                + (f"  {base / t:5.2f}x {'the default' if a.no_dense else 'dense'}" if base else "")
                + (f"  rel err {err:.1e}" if err is not None else ""))
            rows.append(dict(tokens=N, path=name, ms=t * 1e3, tflops=flops / t / 1e12, rel_err=err,
                             vs_dense=(base / t if base else None)))
            if (a.down or a.mask) and name.startswith("kernel"):
                rows[-1]["kernels"] = device_ops(f, args, log, f"N {N:5d} {name}", top=5, hlo=False)
            if name.startswith("kernel") and (best is None or t < best[0]):
                best = (t, [c for n, c in configs if n == name][0] or G.config_for(N * k, a.experts, I, L))
        for c in {G.config_for(N * k, a.experts, I, L), best[1]} if best and not a.no_phases else ():
            try:
                rows.append(dict(tokens=N, path=f"phases {c}", phases_ms=phases(kcfg, w, z, wk, ids, c, log, N)))
            except Exception as e:
                log(f"N {N:5d} phases of {c}: FAILED {type(e).__name__}: {str(e)[:300]}")
    write(a, rows)
    return 0


def write(a, rows: list[dict]) -> None:
    with open(a.json, "w") as fh:
        json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, experts=a.experts, rows=rows), fh,
                  indent=1)


if __name__ == "__main__":
    sys.exit(main())
