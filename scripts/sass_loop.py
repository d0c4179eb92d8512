"""A Pallas kernel's inner loop as an H200 would run it, counted without a GPU: its Triton IR (lowered by the
project's jax on the CPU), compiled for sm_90 by the `triton` package from PyPI (its own LLVM and ptxas), the cubin
disassembled by the cuobjdump that package bundles, and each loop's SASS instructions counted by kind.

It predicts, it does not measure: XLA compiles the same Triton IR with the Triton it bundles, whose registers and
scheduling can differ, and only the GPU says what bounds a loop.  Its use is a kernel change's instruction count before
a device call (docs/PERF.md, thirteenth session: the MXFP4 experts loop's 12.4 instructions a weight, 9.6 with the
scale per group).  Two steps, two Pythons (scripts/sass_loop.sh runs both):

  python scripts/sass_loop.py dump OUT moe_experts --preset k3 --tp 2 --batch 1 [--config scale=group,x_f32=1]
      (the project's venv) writes OUT/<name>_k<i>.ttir, one per kernel of the call;
  python scripts/sass_loop.py count FILE.ttir [--warps 4] [--stages 3] [--weights-per-iter 32]
      (a venv with `triton`) writes FILE.cubin / .sass / .ttgir and prints registers, spills and each loop's mix.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys


def dump(out: str, kernel: str, preset: str, tp: int, batch: int, config: str) -> list[str]:
    """The Triton IR of each Pallas kernel `kernel`'s call lowers to (MXFP4 experts of the preset's TP share)."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering as L

    from jaxk3.tools.bench_decode import load_config
    from jaxk3.tools.triton_lowering import lower

    if kernel != "moe_experts":
        raise SystemExit(f"sass_loop dump: only moe_experts is wired up, got {kernel!r}")
    from jaxk3.kernels import moe_experts as ME
    from jaxk3.layers import moe

    texts: list[str] = []
    orig = L.lower_jaxpr_to_triton_module

    def keep(*a, **k):
        r = orig(*a, **k)
        texts.append(r.module.operation.get_asm(enable_debug_info=False))
        return r
    L.lower_jaxpr_to_triton_module = keep
    cfg = dataclasses.replace(load_config(preset), num_experts=64)
    S, u8 = jax.ShapeDtypeStruct, jnp.uint8
    I, Lh, k = cfg.moe_intermediate_size // tp, cfg.moe_hidden, cfg.num_experts_per_token

    def mx(O, In):
        return ME.MXFP4(S((64, O, In // 2), u8), S((64, O, In // 32), u8))
    w = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=mx(I, Lh), experts_w2=mx(Lh, I),
                       experts_w3=mx(I, Lh))
    kw = {}
    for item in filter(None, config.split(",")):
        key, v = item.split("=")
        kw[key] = int(v) if v.lstrip("-").isdigit() else v
    c = ME.Config(**kw)
    args = (w, S((batch, Lh), jnp.bfloat16), S((batch, k), jnp.float32), S((batch, k), jnp.int32))
    try:
        lower(lambda w, z, wk, ids: ME.experts(cfg, w, z, wk, ids, config=c), *args)
    finally:
        L.lower_jaxpr_to_triton_module = orig
    os.makedirs(out, exist_ok=True)
    name = f"{kernel}_{preset}_tp{tp}_b{batch}" + "".join(f"_{a}{b}" for a, b in kw.items())
    paths = []
    for i, t in enumerate(texts):
        paths.append(os.path.join(out, f"{name}_k{i + 1}.ttir"))
        with open(paths[-1], "w") as f:
            f.write(t)
    return paths


def sass_loops(sass: str) -> list[list[str]]:
    """Each backward branch's body (its target up to the branch), as instruction texts."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\s+(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            loops.append([t for a, t in ins if start <= a <= addr])
    return loops


def kind(text: str) -> str:
    """An instruction's kind: its opcode (loads keep their width: LDG.E.128)."""
    op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
    return op if op.startswith("LDG") else op.split(".")[0]


def count(ttir: str, warps: int, stages: int, per_iter: float) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    k = triton.compile(ttir, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    base = ttir[:-len(".ttir")]
    with open(base + ".cubin", "wb") as f:
        f.write(k.asm["cubin"])
    with open(base + ".ttgir", "w") as f:
        f.write(k.asm["ttgir"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", base + ".cubin"], check=True,
                          capture_output=True, text=True).stdout
    with open(base + ".sass", "w") as f:
        f.write(sass)
    with open(base + ".ptx", "w") as f:
        f.write(k.asm["ptx"])
    info = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", base + ".ptx", "-o", os.devnull],
                          check=True, capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    print(f"{os.path.basename(ttir)}: {regs.group(1) if regs else '?'} registers, {spills.group(1) if spills else '?'} "
          f"bytes of spill stores, {k.asm['ttgir'].count('ttg.convert_layout')} layout conversions in the Triton GPU IR")
    for i, body in enumerate(sass_loops(sass)):
        c = collections.Counter(kind(t) for t in body)
        print(f"  loop {i}: {len(body)} instructions, {len(body) / per_iter:.2f} per weight "
              f"({per_iter:g} weights a thread an iteration)")
        print("    " + ", ".join(f"{op} {n / per_iter:.2f}" for op, n in c.most_common(12)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("kernel")
    d.add_argument("--preset", default="k3")
    d.add_argument("--tp", type=int, default=2)
    d.add_argument("--batch", type=int, default=1)
    d.add_argument("--config", default="")
    c = sub.add_parser("count")
    c.add_argument("ttir")
    c.add_argument("--warps", type=int, default=4)
    c.add_argument("--stages", type=int, default=3)
    c.add_argument("--weights-per-iter", type=float, default=32)
    a = ap.parse_args(argv)
    if a.cmd == "dump":
        sys.path.insert(0, os.getcwd())
        for p in dump(a.out, a.kernel, a.preset, a.tp, a.batch, a.config):
            print(p)
    else:
        count(a.ttir, a.warps, a.stages, a.weights_per_iter)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
