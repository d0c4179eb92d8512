"""The MoE decode experts kernel (`moe_experts`: gate|up with the activation, then down with the combine, over
the distinct selected experts) in its configurations against XLA on one GPU, bf16 and MXFP4 experts, B = 1 and 8,
in the same run (`jaxk3.tools.bench_kernels.moe_experts_cases`: a chain of calls in one jit, the median per call):

  --preset k3   K3's TP 2 share (64 experts kept, top-16), w1 and w3 apart (the checkpoint layout);
  --preset kl   Kimi-Linear-48B at TP 1 (64 experts kept, top-8) in the serving layout: w1 | w3 joined, and
                (bf16) the shared experts fused in the kernel, against XLA's experts + shared experts.

Per row: us per call, GB/s of the weight bytes a call reads (the distinct experts', packed bytes for MXFP4, and
the shared experts'), the ratio to XLA's path for the same format and batch (> 1: the kernel is faster), and
the output's error against XLA's (max |a - b| / max |b|: float32 reassociation, ~1e-6; a config that does not
fit is a row saying why).  Issue 22's targets: MXFP4 >= 2.5 TB/s of packed bytes at B = 1, >= 2.0 at B = 8.

    python scripts/gpu/moe_experts_sweep.py [--preset k3,kl] [--json out/moe_experts_sweep.json] [--batch 1,8] [--all]
        [--formats bf16,mxfp4] [--configs 'bn=256;bn=128,bk=256']
"""
from __future__ import annotations

import argparse
import dataclasses
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

CONFIGS = [Config()] + [Config(bn=bn, bk=bk, splits=sp, decode=d, num_warps=w, num_stages=st)
                        for d in ("select", "bits", "f16", "asm")
                        for bn, bk, sp, w, st in ((16, 256, 0, 8, 3), (32, 256, 0, 4, 3), (16, 128, 0, 4, 4),
                                                  (32, 128, 0, 8, 3), (16, 512, 0, 4, 2), (64, 256, 0, 8, 3))]
QUICK = [Config(), Config(decode="select"), Config(num_warps=8),
         # MXFP4 at B = 1: the scale per weight (the default before the fourteenth session)
         Config(scale="weight", x_f32=False),
         # MXFP4 for B > 1: element-wise (the default before the fifteenth session's tensor-core form)
         Config(mx_dot=False),
         # B > 1 tilings around the defaults (bf16 32 x 128, MXFP4 on the tensor cores 64 x 128)
         Config(bn=64), Config(bk=256), Config(bn=64, bk=256), Config(bn=128), Config(num_stages=4)]

def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="out/moe_experts_sweep.json")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--preset", default="kl,k3", help="kl (Kimi-Linear-48B TP 1, serving layout + shared), k3 (TP 2)")
    ap.add_argument("--all", action="store_true", help="25 configurations instead of QUICK's")
    ap.add_argument("--formats", default="bf16,mxfp4")
    ap.add_argument("--configs", default=None, help="';'-separated Config fields instead of QUICK, e.g. "
                    "'bn=256;bn=128,bk=256' (the default Config first; an empty entry is the default alone)")
    a = ap.parse_args(argv)
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    log = timing.logger(a.json)
    batches = tuple(int(b) for b in a.batch.split(","))
    configs = CONFIGS if a.all else QUICK if a.configs is None else [Config()] + [
        Config(**{k: int(v) if v.lstrip("-").isdigit() else v for k, v in (f.split("=") for f in c.split(","))})
        for c in a.configs.split(";") if c]
    rows = []
    for preset in a.preset.split(","):
        name, tp, layout = {"kl": ("kimi-linear-48b", 1, "serving"), "k3": ("k3", 2, "checkpoint")}[preset]
        cfg = bd.load_config(name)
        log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {name} TP {tp} share, 64 experts, top-"
            f"{cfg.num_experts_per_token}, {layout} layout; {len(configs)} kernel configs")
        got = moe_experts_cases(cfg, tp, 64, batches, chain=20, repeats=5, configs=configs, layout=layout,
                                formats=tuple(a.formats.split(",")))
        short = {f"kernel {c}": "kernel " + (", ".join(f"{f.name}={getattr(c, f.name)!r}"
                                                      for f in dataclasses.fields(c)
                                                      if getattr(c, f.name) != f.default) or "default")
                 for c in configs}
        xla = {(r["format"], r["batch"]): r["us"] for r in got if r["path"] == "xla"}
        for r in got:
            r["preset"] = preset
            path = r["name"] = short.get(r["path"], r["path"])
            head = f"{preset} {r['format']:5s} B {r['batch']} {'+shared ' if r.get('shared') else ''}{path[:100]:60s}"
            if "error" in r:
                log(f"{head} FAILED {r['error'][:200]}")
                continue
            r["x_vs_xla"] = xla[(r["format"], r["batch"])] / r["us"]
            log(f"{head} {r['us']:8.1f} us  {r['gbps']:7.0f} GB/s  {r['x_vs_xla']:5.2f}x XLA  rel err {r['rel_err']:.1e}")
        rows += got
    with open(a.json, "w") as fh:
        json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
