"""The MoE decode experts kernel (`moe_experts`: gate|up with the activation, then down, over the distinct
selected experts) in its configurations against XLA, at K3's TP 2 share (64 experts kept, top-16) on one GPU,
bf16 and MXFP4 weights, B = 1 and 8, in the same run (`jaxk3.tools.bench_kernels.moe_experts_cases`: a chain
of calls in one jit, the median per call).

Per row: us per call, GB/s of the distinct experts' weight bytes (packed bytes for MXFP4), the ratio to
XLA's path for the same format and batch (> 1: the kernel is faster), and the output's error against XLA's
(max |a - b| / max |b|: float32 reassociation, ~1e-6; a config that does not fit is a row saying why).  Issue 22's targets: MXFP4 >= 2.5 TB/s
of packed bytes at B = 1 and >= 2.0 TB/s at B = 8.

    python scripts/gpu/moe_experts_sweep.py [--json out/moe_experts_sweep.json] [--batch 1,8] [--all]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

from jaxk3.kernels.moe_experts import Config  # noqa: E402
from jaxk3.tools import bench_decode as bd  # noqa: E402
from jaxk3.tools.bench_kernels import moe_experts_cases  # noqa: E402

CONFIGS = [Config()] + [Config(bo=bo, groups=g, decode=d, num_warps=w, num_stages=s)
                        for d in ("bits", "select")
                        for bo, g, w, s in ((16, 8, 4, 2), (32, 8, 4, 2), (32, 4, 4, 3), (64, 4, 8, 2),
                                            (64, 8, 8, 2), (16, 16, 4, 2), (128, 2, 8, 2))]
QUICK = [Config(), Config(decode="bits"), Config(bo=32, decode="bits", num_warps=4, num_stages=2),
         Config(bo=64, groups=4, decode="bits", num_warps=8, num_stages=2)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="out/moe_experts_sweep.json")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--all", action="store_true", help="fifteen configurations instead of four")
    a = ap.parse_args(argv)
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    log = timing.logger(a.json)
    cfg = bd.load_config("k3")
    batches = tuple(int(b) for b in a.batch.split(","))
    configs = CONFIGS if a.all else QUICK
    log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; K3 TP 2 share, 64 experts, top-"
        f"{cfg.num_experts_per_token}; {len(configs)} kernel configs")
    rows = moe_experts_cases(cfg, 2, 64, batches, chain=20, repeats=5, configs=configs)
    xla = {(r["format"], r["batch"]): r["us"] for r in rows if r["path"] == "xla"}
    for r in rows:
        head = f"{r['format']:5s} B {r['batch']}  {r['path'][:110]:110s}"
        if "error" in r:
            log(f"{head} FAILED {r['error'][:200]}")
            continue
        r["x_vs_xla"] = xla[(r["format"], r["batch"])] / r["us"]
        log(f"{head} {r['us']:8.1f} us  {r['gbps']:7.0f} GB/s  {r['x_vs_xla']:5.2f}x XLA  rel err {r['rel_err']:.1e}")
    with open(a.json, "w") as fh:
        json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
