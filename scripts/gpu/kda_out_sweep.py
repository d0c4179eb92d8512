"""KDA's decode step with its gated norm and o_proj in one kernel (`kda_decode_out`) at Kimi-Linear-48B's dims (32
heads of 128, o_proj 2304 x 4096, one token, the ring conv cache) in its configurations, against the two kernels it
replaces (`kda_decode_in` leaving o un-normed, then `gemv_gnorm`) and XLA's path (their references), in the same run:
each a chain of CHAIN steps in one jit, each step reading the state and ring the last one wrote (the chain's only
dependency: no kernel of its own), the outputs summed; the median per step.  Prints us, the error of the output
against the two kernels', and on its last line `best: PATCH` (step_with_kernel.py's arguments for the fastest
configuration, or `best: kda_decode_out` when none beats the default by 3%).

    python scripts/gpu/kda_out_sweep.py [--json PATH]
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

from jaxk3 import kernels  # noqa: E402
from jaxk3.kernels import kda_decode as KD  # noqa: E402
from jaxk3.kernels.kda_decode_out import Config  # noqa: E402
from jaxk3.tools.bench_decode import load_config  # noqa: E402

CHAIN, INNER, REPS = 20, 5, 7
CONFIGS = [Config(), Config(bn=256), Config(bn=64), Config(bn=256, num_warps=8), Config(bv=16), Config(bv=16, bn=256),
           Config(bv=64, bn=64), Config(num_stages=4), Config(bn=256, num_stages=2)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "kda_out_sweep.json"))
    a = ap.parse_args(argv)
    log = timing.logger(a.json)
    dev = jax.devices()[0]
    cfg = load_config("kimi-linear-48b")
    C, H, d, K, N = cfg.kda_dim, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size, cfg.hidden_size
    r = np.random.default_rng(0)

    def arr(*shape, s=1.0, dt=jnp.float32):
        return jnp.asarray(r.standard_normal(shape) * s, dt)
    cw = KD.CoreWeights(conv_3CK=arr(3, C, K, s=0.3), dt_bias_C=arr(C),
                        A_log_H=jnp.log(jnp.asarray(r.uniform(1, 16, H), jnp.float32)), o_norm_K=1 + arr(d, s=0.1))
    y, gb = arr(1, 3 * C + 2 * d + H), arr(2, C, d, s=d ** -0.5, dt=jnp.bfloat16)
    ring, state = arr(1, 3, C, K, dt=jnp.bfloat16), arr(1, H, d, d, s=0.1)
    valid, pos, w_o = jnp.asarray([True]), jnp.asarray([7], jnp.int32), arr(N, C, s=C ** -0.5, dt=jnp.bfloat16)
    dt, eps = jnp.bfloat16, cfg.rms_norm_eps

    def two_kernels(ring, state):
        o, z, ring, state = kernels.call("kda_decode_in", cfg, y, gb, ring, cw, state, valid, mode="on", gated=False,
                                         pos_B=pos)
        return kernels.call("gemv_gnorm", o, z, cw.o_norm_K, eps, w_o, dt, mode="on"), ring, state

    def xla(ring, state):
        return kernels.REGISTRY["kda_decode_out"].reference(cfg, y, gb, ring, cw, state, valid, w_o, dt, pos_B=pos)

    def fused(c):
        return lambda ring, state: kernels.call("kda_decode_out", cfg, y, gb, ring, cw, state, valid, w_o, dt,
                                                mode="on", config=c, pos_B=pos)

    def chained(f):
        def run(ring, state):
            acc = jnp.zeros((1, N), jnp.float32)
            for _ in range(CHAIN):
                out, ring, state = f(ring, state)
                acc = acc + out
            return acc, ring, state
        return jax.jit(run)

    paths = [("xla", xla), ("kda_decode_in + gemv_gnorm", two_kernels)] + [
        (f"kda_decode_out {c}", fused(c)) for c in CONFIGS]
    log(f"# kda_decode_out at the 48B's dims (H {H}, d {d}, N {N}, C {C}), B 1, on {dev.device_kind}, "
        f"jax {jax.__version__}, chain {CHAIN}")
    rows, want = [], None
    for name, f in paths:
        try:
            c = chained(f)
            got = np.asarray(c(ring, state)[0])
            us = timing.per_call(c, (ring, state), reps=REPS, inner=INNER, chain=CHAIN) * 1e6
        except Exception as e:  # a configuration that does not compile is a row
            rows.append({"path": name, "error": str(e)[:300]})
            log(f"{name[:60]:60s} FAILED {str(e)[:150]}")
            continue
        if name.startswith("kda_decode_in"):
            want = got
        err = float(np.abs(got - want).max() / np.abs(want).max()) if want is not None else 0.0
        rows.append({"path": name, "us": us, "rel_err": err})
        log(f"{name[:60]:60s} {us:7.2f} us  rel err vs the two kernels {err:.1e}")
    fused_rows = [x for x in rows if x["path"].startswith("kda_decode_out") and "us" in x]
    best = "kda_decode_out"
    if fused_rows:
        top = min(fused_rows, key=lambda x: x["us"])
        if top["us"] < 0.97 * fused_rows[0]["us"] and top is not fused_rows[0]:
            i = [x["path"] for x in rows].index(top["path"]) - 2
            c = CONFIGS[i]
            best = "+".join(["kda_decode_out"] + [f"kda_decode_out:Config.{f.name}={getattr(c, f.name)}"
                                                  for f in dataclasses.fields(c)
                                                  if getattr(c, f.name) != f.default])
    with open(a.json, "w") as fh:
        json.dump({"device": dev.device_kind, "jax": jax.__version__, "rows": rows, "best": best}, fh, indent=1)
    log(f"best: {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
