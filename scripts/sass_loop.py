"""A Pallas kernel's inner loop as an H200 would run it, counted without a GPU: its Triton IR (lowered by the
project's jax on the CPU), compiled for sm_90 by the `triton` package from PyPI (its own LLVM and ptxas), the cubin
disassembled by the cuobjdump that package bundles, and each loop's SASS instructions counted by kind.

It predicts, it does not measure: XLA compiles the same Triton IR with the Triton it bundles, whose registers and
scheduling can differ, and only the GPU says what bounds a loop.  Its use is a kernel change's instruction count before
a device call (docs/PERF.md, thirteenth session: the MXFP4 experts loop's 12.4 instructions a weight, 9.6 with the
scale per group).  Two steps, two Pythons (scripts/sass_loop.sh runs both):

  python scripts/sass_loop.py dump OUT KERNEL --preset k3 --tp 2 --batch 1 [--config scale=group,x_f32=1]
      [--patch MODULE:NAME=VALUE ...]
      (the project's venv) writes OUT/<name>_k<i>.ttir, one per kernel of the call.  KERNEL: moe_experts (MXFP4,
      Config fields by --config), moe_experts_routed (bf16, the serving layout with the shared experts),
      kda_decode_in, gemv_norm (KDA's fused in_proj), gemv_gnorm (KDA's o_proj); --patch sets a constant or
      a config default of jaxk3.kernels.MODULE for the dump, as scripts/gpu/step_with_kernel.py does;
  python scripts/sass_loop.py count FILE.ttir [--warps 4] [--stages 3] [--weights-per-iter 32]
      (a venv with `triton`) writes FILE.cubin / .sass / .ttgir and prints registers, spills, the global loads
      against the barriers in program order (`mem_order`) and each loop's mix.

The fourteenth session's lesson (docs/PERF.md): a loop whose loads wait on each other's round trips in this listing
was not slower on the H200 for it, and forms that issued them together (more registers) were slower: the counts
say what a loop executes, not what bounds a kernel that many resident programs share.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys


KERNELS = ("moe_experts", "moe_experts_routed", "kda_decode_in", "gemv_norm", "gemv_gnorm")


def _call(kernel: str, cfg, tp: int, batch: int, kw: dict):
    """(fn, abstract args) of one call of `kernel` at the preset's per-rank dims: the MXFP4 experts (64 kept) with
    Config(**kw), or at B = 1 the KDA decode core reading in_proj's output (the serving layout, the ring), the normed
    GEMV of KDA's fused in_proj, or o_proj with the gated norm in its prologue."""
    import jax
    import jax.numpy as jnp

    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    if kernel == "moe_experts":
        from jaxk3.kernels import moe_experts as ME
        from jaxk3.layers import moe

        u8 = jnp.uint8
        I, Lh, k = cfg.moe_intermediate_size // tp, cfg.moe_hidden, cfg.num_experts_per_token

        def mx(O, In):
            return ME.MXFP4(S((64, O, In // 2), u8), S((64, O, In // 32), u8))
        w = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=mx(I, Lh), experts_w2=mx(Lh, I),
                           experts_w3=mx(I, Lh))
        c = ME.Config(**kw)
        return (lambda w, z, wk, ids: ME.experts(cfg, w, z, wk, ids, config=c),
                (w, S((batch, Lh), bf), S((batch, k), f32), S((batch, k), jnp.int32)))
    if kernel == "moe_experts_routed":  # bf16, the serving layout's [w1 | w3] and the shared experts in the kernels
        from jaxk3.kernels import moe_experts as ME
        from jaxk3.layers import moe

        I, Lh, Is = cfg.moe_intermediate_size // tp, cfg.moe_hidden, cfg.shared_intermediate_size // tp
        w = moe.MoEWeights(gate=None, e_score_correction_bias=None, experts_w1=None, experts_w3=None,
                           experts_w2=S((64, Lh, I), bf), experts_w13=S((64, 2 * I, Lh), bf))
        sh = ME.SharedMLP(S((2 * Is, Lh), bf), S((Lh, Is), bf))
        c = ME.Config(**kw)
        return (lambda w, sh, z, lg, bias: ME.experts_routed(cfg, w, z, lg, bias, shared=sh, config=c),
                (w, sh, S((1, Lh), bf), S((1, 64), f32), S((64,), f32)))
    D, Kd, d = cfg.hidden_size, cfg.kda_head_dim, cfg.kda_head_dim  # the low rank of f_a / g_a is the head dim
    H = cfg.kda_num_heads // tp
    C = H * Kd
    if kernel == "kda_decode_in":
        from jaxk3.kernels import kda_decode as KD

        K = cfg.short_conv_kernel_size
        cw = KD.CoreWeights(S((3, C, K), f32), S((C,), f32), S((H,), f32), S((Kd,), f32))
        return (lambda y, gb, conv, cw, st, valid, pos: KD.kda_decode_in(cfg, y, gb, conv, cw, st, valid, pos_B=pos),
                (S((batch, 3 * C + 2 * d + H), f32), S((2, C, d), bf), S((batch, 3, C, K), bf), cw,
                 S((batch, H, Kd, Kd), f32), S((batch,), jnp.int32), S((batch,), jnp.int32)))
    from jaxk3.kernels import gemv as GV

    if kernel == "gemv_norm":
        N = 3 * C + 2 * d + H
        return (lambda x, w, g: GV._norm_device(x, w, g, 1e-6), (S((batch, D), bf), S((N, D), bf), S((D,), bf)))
    return (lambda x, z, g, w: GV.gemv_gnorm(x, z, g, 1e-6, w, bf),
            (S((1, C), f32), S((1, C), f32), S((Kd,), f32), S((D, C), bf)))


def dump(out: str, kernel: str, preset: str, tp: int, batch: int, config: str, patches: list[str] = ()) -> list[str]:
    """The Triton IR of each Pallas kernel `kernel`'s call lowers to (`_call`), with `patches` applied as
    scripts/gpu/step_with_kernel.py applies them (MODULE:NAME=VALUE a constant of jaxk3.kernels.MODULE,
    MODULE:CLASS.FIELD=VALUE a config default; its notes go to stderr, stdout is the files written)."""
    import contextlib
    import importlib.util

    from jax._src.pallas.triton import lowering as L

    from jaxk3.tools.bench_decode import load_config
    from jaxk3.tools.triton_lowering import lower

    if kernel not in KERNELS:
        raise SystemExit(f"sass_loop dump: wired up for {', '.join(KERNELS)}, got {kernel!r}")
    if patches:
        spec = importlib.util.spec_from_file_location(
            "step_with_kernel", os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu", "step_with_kernel.py"))
        swk = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(swk)
        with contextlib.redirect_stdout(sys.stderr):
            for p in patches:
                swk.set_default(p)
    texts: list[str] = []
    orig = L.lower_jaxpr_to_triton_module

    def keep(*a, **k):
        r = orig(*a, **k)
        texts.append(r.module.operation.get_asm(enable_debug_info=False))
        return r
    L.lower_jaxpr_to_triton_module = keep
    cfg = dataclasses.replace(load_config(preset), num_experts=64)
    kw = {}
    for item in filter(None, config.split(",")):
        key, v = item.split("=")
        kw[key] = int(v) if v.lstrip("-").isdigit() else v
    fn, args = _call(kernel, cfg, tp, batch, kw)
    try:
        lower(fn, *args)
    finally:
        L.lower_jaxpr_to_triton_module = orig
    os.makedirs(out, exist_ok=True)
    name = (f"{kernel}_{preset}_tp{tp}_b{batch}" + "".join(f"_{a}{b}" for a, b in kw.items())
            + "".join("_" + re.sub(r"\W", "", p.split(":")[-1]) for p in patches))
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


def mem_order(sass: str) -> str:
    """The global loads, barriers and global stores in program order, runs counted: LDG.E.128x4 BAR.SYNCx1 ...; where
    a kernel's loads stand against its reductions' barriers."""
    runs: list[list] = []
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?((?:LDG|BAR|STG)[\w.]*)", sass):
        op = m.group(1)
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return " ".join(f"{op}x{n}" for op, n in runs)


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
    print("  memory order: " + mem_order(sass))
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
    d.add_argument("--patch", action="append", default=[],
                   help="MODULE:NAME=VALUE (a jaxk3.kernels constant) or MODULE:CLASS.FIELD=VALUE, as step_with_kernel.py")
    c = sub.add_parser("count")
    c.add_argument("ttir")
    c.add_argument("--warps", type=int, default=4)
    c.add_argument("--stages", type=int, default=3)
    c.add_argument("--weights-per-iter", type=float, default=32)
    a = ap.parse_args(argv)
    if a.cmd == "dump":
        sys.path.insert(0, os.getcwd())
        for p in dump(a.out, a.kernel, a.preset, a.tp, a.batch, a.config, a.patch):
            print(p)
    else:
        count(a.ttir, a.warps, a.stages, a.weights_per_iter)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
