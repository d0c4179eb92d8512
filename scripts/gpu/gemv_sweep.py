"""GEMV sweep on one GPU: the Pallas GEMV (jaxk3.kernels.gemv) over block sizes / warps / stages /
K splits / layouts, against XLA's dot in the same run, and a hand-written CUDA GEMV through
cupy.RawKernel as the hardware ceiling (a measurement only, not shipped).

Timing, as the decode step uses a GEMV: one jit holds a dependent chain of CHAIN GEMVs, each
followed by an add into the next input (x <- x + 1e-3 * y[:, :K]); the weights rotate through
enough distinct matrices that they never sit in the 60 MB L2.  Per config: the median over REPS of
(wall time of INNER back-to-back calls) / (INNER * CHAIN).  The CUDA kernel is timed with CUDA
events over back-to-back launches on distinct weights (no epilogue: a ceiling).

    python scripts/gpu/gemv_sweep.py [--quick] [--budget S] [--json PATH] [--cases NAME,...]
On a CPU this runs the kernel in interpret mode on tiny shapes (plumbing only).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402
from jaxk3.kernels import gemv as G  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
CHAIN, INNER, REPS = 20, 10, 15
L2 = 60e6

# (name, B, N, K): the projections of the two presets
CASES = [
    ("kl_sq", 1, 2304, 2304), ("kl_gateup", 1, 18432, 2304), ("kl_qkv", 1, 12288, 2304), ("kl_oproj", 1, 2304, 4096),
    ("k3_qa", 1, 1536, 7168), ("k3_qkv_tp8", 1, 4608, 7168), ("kl_down", 1, 2304, 9216), ("k3_o_tp8", 1, 7168, 1536),
    ("kl_sq", 8, 2304, 2304), ("kl_gateup", 8, 18432, 2304), ("kl_oproj", 8, 2304, 4096), ("k3_qa", 8, 1536, 7168),
    # the serving layout's fused projections (jaxk3.layers: Fuse): Kimi-Linear KDA q|k|v|f_a|b|g_a, MLA
    # kv_a|q_proj, shared experts gate|up; K3 at TP 8: KDA q|k|v|f_a|b|g, MLA q_a|kv_a|g
    ("kl_kda_in", 1, 12576, 2304), ("kl_mla_in", 1, 6720, 2304), ("kl_shared_gu", 1, 2048, 2304),
    ("kl_kda_in", 8, 12576, 2304), ("kl_mla_in", 8, 6720, 2304), ("kl_shared_gu", 8, 2048, 2304),
    ("k3_kda_in_tp8", 1, 6284, 7168), ("k3_mla_in_tp8", 1, 1800, 7168),
]


def splits_for(N: int, K: int, bn: int, bk: int, target: int) -> int:
    steps = K // bk
    best = 1
    for s in range(1, steps + 1):
        if steps % s == 0:
            best = s
            if (N // bn) * s >= target:
                break
    return best


def configs(B: int, N: int, K: int) -> list[tuple[str, G.Config]]:
    """(layout, config) candidates, the likeliest first."""
    def C(bn, bk, target, dot, nw, ns, layout="nk", unroll=False):
        if N % bn or K % bk:
            return None
        return layout, G.Config(bn=bn, bk=bk, splits=splits_for(N, K, bn, bk, target), dot=dot, num_warps=nw,
                                num_stages=ns, unroll=unroll)
    if B == 1:
        out = [C(16, 256, 528, False, 4, 3), C(16, 512, 528, False, 4, 3), C(32, 256, 528, False, 4, 3),
               C(8, 512, 528, False, 4, 3), C(16, 256, 1056, False, 4, 3), C(16, 256, 264, False, 4, 3),
               C(16, 256, 528, False, 4, 1), C(16, 256, 528, False, 4, 4), C(16, 256, 528, False, 8, 3),
               C(16, 256, 528, False, 4, 3, unroll=True), C(32, 256, 264, False, 8, 3, unroll=True),
               C(32, 512, 528, False, 8, 3), C(16, 256, 528, True, 4, 3), C(16, 128, 528, True, 4, 4),
               C(64, 64, 528, False, 4, 3, "kn"), C(128, 64, 528, False, 4, 3, "kn"), C(64, 128, 528, True, 4, 3, "kn")]
    else:
        out = [C(16, 256, 528, True, 4, 3), C(32, 256, 528, True, 4, 3), C(16, 512, 528, True, 4, 3),
               C(16, 256, 528, True, 4, 3, unroll=True),
               C(32, 128, 528, True, 4, 4), C(16, 256, 1056, True, 4, 3), C(16, 256, 528, True, 8, 3),
               C(64, 128, 528, True, 4, 3), C(64, 128, 528, True, 4, 3, "kn"),
               C(32, 128, 528, True, 4, 3), C(32, 256, 264, True, 4, 4), C(64, 256, 264, True, 8, 3),
               C(32, 128, 1056, True, 4, 4)]
    seen, res = set(), []
    for c in out:
        if c and c not in seen:
            seen.add(c)
            res.append(c)
    return res


def cfg_str(layout, c: G.Config) -> str:
    return (f"{layout} bn{c.bn} bk{c.bk} s{c.splits} {'dot' if c.dot else 'ew'} w{c.num_warps} st{c.num_stages}"
            + (" unroll" if c.unroll else ""))


def chain_fn(gemv, N: int, K: int, nw: int):
    def f(x, ws):
        for i in range(CHAIN):
            y = gemv(x, ws[i % nw])
            y = y[:, :K] if N >= K else jnp.pad(y, ((0, 0), (0, K - N)))
            x = (x.astype(F32) + 1e-3 * y).astype(BF16)
        return x
    return jax.jit(f)


def time_compiled(c, args) -> float:
    return timing.per_call(c, args, reps=REPS, inner=INNER, chain=CHAIN)


# ------------------------------------------------------------------------------- CUDA ceiling
CUDA_SRC = r"""
__device__ __forceinline__ void unpack8(const uint4 v, float* f) {
  const unsigned int* u = reinterpret_cast<const unsigned int*>(&v);
  #pragma unroll
  for (int j = 0; j < 4; ++j) { f[2 * j] = __uint_as_float(u[j] << 16); f[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u); }
}
// W [N, K] bf16 row-major (uint4 = 8 values), X [BB, K] bf16, Y [ksplit, BB, N] fp32 partial sums.
// A warp owns R rows and one of ksplit parts of K; lanes stride 16-byte loads along K.
extern "C" __global__ void __launch_bounds__(256) gemv(const uint4* __restrict__ W, const uint4* __restrict__ X,
                                                       float* __restrict__ Y, int N, int K, int ksplit) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  const int row0 = warp * R;
  if (row0 >= N) return;
  const int s = blockIdx.y, K8 = K >> 3, chunk = K8 / ksplit, kb = s * chunk, ke = kb + chunk;
  float acc[R][BB];
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int b = 0; b < BB; ++b) acc[r][b] = 0.f;
  #pragma unroll 4
  for (int k = kb + lane; k < ke; k += 32) {
    uint4 w[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) w[r] = __ldcs(&W[(size_t)(row0 + r) * K8 + k]);
    #pragma unroll
    for (int b = 0; b < BB; ++b) {
      float xf[8];
      unpack8(__ldg(&X[(size_t)b * K8 + k]), xf);
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        float wf[8];
        unpack8(w[r], wf);
        #pragma unroll
        for (int j = 0; j < 8; ++j) acc[r][b] += wf[j] * xf[j];
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int b = 0; b < BB; ++b) {
      float v = acc[r][b];
      #pragma unroll
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) Y[((size_t)s * BB + b) * N + row0 + r] = v;
    }
}
"""
_MODS: dict = {}


def cuda_ceiling(B: int, N: int, K: int, nbytes: int, log) -> list[dict]:
    import cupy as cp

    nw = min(20, max(2, math.ceil(3 * L2 / nbytes)))
    rng = cp.random.default_rng(0)

    def bf16(shape):
        f = (rng.standard_normal(shape, dtype=cp.float32) * 0.05).astype(cp.float32)
        return (f.view(cp.uint32) >> 16).astype(cp.uint16)
    Ws = [bf16((N, K)) for _ in range(nw)]
    X = bf16((B, K))
    rows = []
    for R in (1, 2, 4):
        if N % R:
            continue
        key = (R, B)
        if key not in _MODS:
            _MODS[key] = cp.RawModule(code=CUDA_SRC, options=(f"-DR={R}", f"-DBB={B}", "--std=c++17"))
        fn = _MODS[key].get_function("gemv")
        warps = N // R
        blocks = -(-warps // 8)
        done = set()
        for target in (264, 528, 1056):
            ks = 1
            K8 = K // 8
            for s in range(1, K8 // 32 + 1):
                if K8 % s == 0 and (K8 // s) % 32 == 0:
                    ks = s
                    if blocks * s * 8 >= target * 8 // 2:  # warps in flight: >= target * 4
                        break
            if ks in done:
                continue
            done.add(ks)
            Y = cp.empty((ks, B, N), cp.float32)
            args = lambda w: (w, X, Y, np.int32(N), np.int32(K), np.int32(ks))  # noqa: E731
            fn((blocks, ks), (256,), args(Ws[0]))
            cp.cuda.Device().synchronize()
            if len(rows) == 0:  # correctness once per case
                ref = (X.astype(cp.uint32) << 16).view(cp.float32) @ (Ws[0].astype(cp.uint32) << 16).view(cp.float32).T
                err = float(cp.abs(Y.sum(0) - ref).max() / cp.abs(ref).max())
            else:
                err = None
            n = 200
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            ts = []
            for _ in range(5):
                e0.record()
                for i in range(n):
                    fn((blocks, ks), (256,), args(Ws[i % nw]))
                e1.record()
                e1.synchronize()
                ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / n)
            us = statistics.median(ts)
            rows.append(dict(variant=f"cuda R{R} ks{ks}", us=us, tbps=nbytes / us / 1e6, err=err))
            log(f"    cuda R{R} ks{ks}: {us:7.2f} us {nbytes / us / 1e6:5.2f} TB/s" + (f" err {err:.1e}" if err is not None else ""))
    del Ws
    return rows


# ------------------------------------------------------------------------------- the sweep
def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=170.0, help="seconds for the Pallas sweep, all cases")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "gemv.json"))
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--no-cuda", action="store_true")
    ap.add_argument("--batch", type=int, default=0, help="only this batch (default: all)")
    ap.add_argument("--only", default="", help="'pick': only the tuned/default config per case")
    a = ap.parse_args(argv)
    cpu = jax.devices()[0].platform == "cpu"
    global CHAIN, INNER, REPS
    cases = CASES
    if a.cases:
        cases = [c for c in CASES if c[0] in a.cases.split(",")]
    if a.batch:
        cases = [c for c in cases if c[1] == a.batch]
    if cpu:
        CHAIN, INNER, REPS = 2, 1, 1
        cases = [("cpu_tiny", 1, 64, 512), ("cpu_tiny", 8, 32, 768)]
    log = timing.logger(a.json)
    dev = jax.devices()[0]
    log(f"# gemv sweep on {dev.platform} {dev.device_kind}, jax {jax.__version__}, chain {CHAIN}, inner {INNER}, reps {REPS}")
    t_start = time.time()
    results = []
    pool = cf.ThreadPoolExecutor(max_workers=max(2, min(12, (os.cpu_count() or 2) - 2)))
    for name, B, N, K in cases:
        nbytes = N * K * 2
        nw = min(20, max(2, math.ceil(3 * L2 / nbytes)))
        log(f"== {name} B={B} N={N} K={K} ({nbytes / 1e6:.1f} MB, {nw} distinct weights)")
        key = jax.random.key(N + K + B)
        ws = tuple((jax.random.normal(jax.random.fold_in(key, i), (N, K), F32) * 0.05).astype(BF16) for i in range(nw))
        wsT = None
        x = (jax.random.normal(key, (B, K), F32)).astype(BF16)
        row = dict(case=name, B=B, N=N, K=K, MB=nbytes / 1e6, variants=[])
        cands = [("xla nk", lambda x, w: G.reference(x, w, "nk"), "nk"),
                 ("xla kn", lambda x, w: G.reference(x, w, "kn"), "kn")]
        cfgs = configs(B, N, K)
        if a.only == "pick":
            cfgs = [("nk", G.config_for(B, N, K, "nk"))]
        for layout, c in cfgs:
            cands.append((cfg_str(layout, c), lambda x, w, layout=layout, c=c: G.gemv(x, w, layout, c, interpret=cpu),
                          layout))
        over = time.time() - t_start > a.budget
        if over:
            cands = cands[:3]
            log("   (budget spent: XLA and the first config only)")
        if any(l == "kn" for _, _, l in cands):
            wsT = jax.block_until_ready(tuple(jnp.asarray(jnp.transpose(w)) for w in ws))

        def compile_one(cand):
            label, fn, layout = cand
            try:
                args = (x, ws if layout == "nk" else wsT)
                return label, chain_fn(fn, N, K, nw).lower(*args).compile(), args, None
            except Exception as e:  # noqa: BLE001
                return label, None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        compiled = list(pool.map(compile_one, cands))
        # correctness of each kernel variant against XLA once (one GEMV, not the chain)
        ref1 = np.asarray(G.reference(x, ws[0]))
        xla_us = None
        for (label, c, args, err), (_, fn, layout) in zip(compiled, cands):
            if c is None:
                log(f"    {label:<40} COMPILE FAILED {err}")
                row["variants"].append(dict(variant=label, error=err))
                continue
            try:
                got = np.asarray(jax.jit(fn)(x, args[1][0]))
                rel = float(np.abs(got - ref1).max() / np.abs(ref1).max())
                us = time_compiled(c, args) * 1e6
            except Exception as e:  # noqa: BLE001
                log(f"    {label:<40} RUN FAILED {type(e).__name__}: {str(e)[:300]}")
                row["variants"].append(dict(variant=label, error=str(e)[:300]))
                continue
            if label == "xla nk":
                xla_us = us
            tb = nbytes / us / 1e6
            row["variants"].append(dict(variant=label, us=us, tbps=tb, err=rel, x_vs_xla=xla_us / us if xla_us else None))
            log(f"    {label:<40} {us:8.2f} us {tb:5.2f} TB/s  x{(xla_us or us) / us:5.2f} vs xla  err {rel:.1e}")
        del compiled
        if not cpu and not a.no_cuda:
            try:
                row["variants"] += cuda_ceiling(B, N, K, nbytes, log)
            except Exception as e:  # noqa: BLE001
                log(f"    cuda ceiling FAILED: {type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc()
        results.append(row)
        del ws, wsT
        with open(a.json, "w") as f:
            json.dump(dict(device=f"{dev.platform} {dev.device_kind}", jax=jax.__version__, rows=results), f, indent=1)
    # the short table
    log("\n# GEMV summary: best Pallas config vs XLA (nk) vs CUDA ceiling, TB/s of weight bytes")
    log(f"{'case':<12}{'B':>2} {'MB':>6} {'xla us':>7} {'xla':>5} {'pallas us':>9} {'pallas':>6} {'cuda':>5}  best pallas config")
    for r in results:
        v = r["variants"]
        xla = next((x for x in v if x["variant"] == "xla nk" and "us" in x), None)
        pal = [x for x in v if "us" in x and not x["variant"].startswith(("xla", "cuda"))]
        cu = [x for x in v if "us" in x and x["variant"].startswith("cuda")]
        bp = min(pal, key=lambda x: x["us"]) if pal else None
        bc = min(cu, key=lambda x: x["us"]) if cu else None
        log(f"{r['case']:<12}{r['B']:>2} {r['MB']:>6.1f} {xla['us'] if xla else float('nan'):>7.1f} "
            f"{xla['tbps'] if xla else float('nan'):>5.2f} {bp['us'] if bp else float('nan'):>9.1f} "
            f"{bp['tbps'] if bp else float('nan'):>6.2f} {bc['tbps'] if bc else float('nan'):>5.2f}  "
            f"{bp['variant'] if bp else '-'}")
    log(f"# sweep took {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
