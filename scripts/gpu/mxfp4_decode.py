"""What bounds the MXFP4 experts at B = 1 (issue 22): one GEMV y = W x over an MXFP4 matrix [O, In] on one GPU, its
codes decoded four ways in the same run, beside bf16 and XLA's paths over the same matrix.

  xla-bf16     XLA's dot over the dequantised matrix stored in bf16 (4x the bytes: the streaming mark)
  xla-mxfp4    XLA's fused dequantisation then dot (what `auto` runs for packed experts at B = 1)
  bf16         the experts kernel's B = 1 inner loop (jaxk3.kernels.moe_experts._gemv_rows) over the bf16 matrix
  f16          the same loop over the packed codes, decode "f16" (the default: float16's bits, then a float16 ->
               float32 conversion and two products per weight)
  select       the same loop, decode "select" (compares and selects)
  magic        the same loop, decode "magic" (no conversion: a code's magnitude looked up in a 32-bit constant, placed
               in a float32's mantissa under the exponent of 2^23 and 2^23 subtracted, the sign's bit XORed in; the
               block's scale applied once per 32-value group after its sum: exact)
  half         no conversion, float16 arithmetic: two codes of one int32 word made float16 bits by whole-word
               operations, the products with x (float16, scaled by 2^10) summed in float16 over 8 terms, then in
               float32 per group (not bitwise: float16 sums; the error is printed)

The hypothesis it tests (docs/PERF.md, twelfth session): the f16 decode is bound by its ~2.5 conversions per weight,
so the conversion-free forms should stream the packed bytes 2-3x faster. Per row: us per call (a chain of CHAIN
dependent calls in one jit, the median of REPS x INNER), GB/s of the bytes it reads (codes + scales, or bf16), and the
relative error against a float64 product of the dequantised matrix.

    python scripts/gpu/mxfp4_decode.py [--rows 14336] [--cols 3584] [--json PATH]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

from jaxk3.kernels import moe_experts as ME  # noqa: E402
from jaxk3.kernels.registry import triton_params  # noqa: E402

F32, G32 = jnp.float32, 32
CHAIN, INNER, REPS = 10, 3, 7
FORMS = ("xla-bf16", "xla-mxfp4", "bf16", "f16", "select", "magic", "half")
HALF_X_SCALE = 2.0 ** 10  # x's scale in the half form: products v·2^-14·x·2^10 stay float16 normals for |x| ~ 1


def case(O: int, In: int, seed: int = 0):
    """(MXFP4 codes [O, In/2] uint8, scales [O, In/32] uint8 (2^-8 .. 2^-5), x [In] bf16): every code drawn."""
    r = np.random.default_rng(seed)
    packed = jnp.asarray(r.integers(0, 256, (O, In // 2)), jnp.uint8)
    scale = jnp.asarray(r.integers(119, 123, (O, In // G32)), jnp.uint8)
    x = jnp.asarray(r.standard_normal(In), jnp.bfloat16)
    return packed, scale, x


def reference(packed, scale, x) -> np.ndarray:
    """float64 W x from the dequantised matrix (every value exact)."""
    w = np.asarray(ME.dequantize(ME.MXFP4(packed, scale)), np.float64)
    return w @ np.asarray(x.astype(F32), np.float64)


def _rows(bn: int):
    from jax.experimental import pallas as pl

    return pl.ds(pl.multiple_of(pl.program_id(0) * bn, bn), bn)


def _loop_kernel(*refs, sp, nw: int, steps: int):
    """The experts kernel's own B = 1 inner loop over one 2-D weight (bf16, or codes and scales)."""
    w, x, o_ref = refs[:nw], refs[nw:-1], refs[-1]
    rows = _rows(sp.bn)
    o_ref[0, rows] = ME._gemv_rows(sp, w, None, rows, x, (), steps)


def _half_kernel(w_ref, s_ref, x_ref, o_ref, *, bn: int, bk: int, steps: int):
    """Words [O, In/32, 4] int32 (word q of a group: columns 8q .. 8q+7, nibble i at bits 4i); x [In/32, 8, 4] float16
    (x[g, i, q] = column 32g + 8q + i, times HALF_X_SCALE)."""
    from jax.experimental import pallas as pl

    rows, g = _rows(bn), bk // G32

    def f16(bits):
        return lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16)

    def body(i, acc):
        grp = pl.ds(pl.multiple_of(i * g, g), g)
        words = w_ref[rows, grp, :]  # [bn, g, 4]
        s16 = jnp.zeros((bn, g, 4), jnp.float16)
        for j in range(4):  # nibbles j and j + 4 of each word: bits 0 and 16 of t
            t = words >> (4 * j)
            h = ((t & 0x00070007) << 9) | ((t & 0x00080008) << 12)  # float16 bits of value · 2^-14 in both halves
            s16 = s16 + f16(h & 0xFFFF) * x_ref[grp, j, :][None] + f16(h >> 16) * x_ref[grp, 4 + j, :][None]
        return acc + jnp.sum(s16.astype(F32), axis=2) * ME.e8m0_scales(s_ref[rows, grp])
    acc = lax.fori_loop(0, steps, body, jnp.zeros((bn, g), F32))
    o_ref[0, rows] = jnp.sum(acc, axis=1) * F32(2.0 ** 14 / HALF_X_SCALE)


def build(form: str, packed, scale, bn: int = 16, bk: int = 256, interpret: bool = False):
    """(f(ops, x) -> y [O] fp32, ops: the weights as f reads them, bytes f reads per call).  The weights are
    arguments of the jitted calls, never closed over: XLA would fold a dequantisation of constants at compile time."""
    from jax.experimental import pallas as pl

    O, In = packed.shape[0], packed.shape[1] * 2
    steps, any_ = In // bk, pl.BlockSpec(memory_space=pl.ANY)
    qbytes = packed.size + scale.size
    out = jax.ShapeDtypeStruct((1, O), F32)
    call = functools.partial(pl.pallas_call, grid=(O // bn,), out_specs=any_, out_shape=out, interpret=interpret,
                             **triton_params(4, 3, interpret))
    if form in ("xla-bf16", "bf16"):
        wb = ME.dequantize(ME.MXFP4(packed, scale)).astype(jnp.bfloat16)
        if form == "xla-bf16":
            return (lambda w, x: jnp.dot(w, x, preferred_element_type=F32)), wb, wb.size * 2
        sp = ME._Spec(Bp=1, packed=False, bn=bn, bk=bk, decode="f16")
        k = call(functools.partial(_loop_kernel, sp=sp, nw=1, steps=steps), in_specs=[any_] * 2)
        return (lambda w, x: k(w, x[None])[0]), wb, wb.size * 2
    if form == "xla-mxfp4":
        return (lambda w, x: jnp.dot(ME.dequantize(ME.MXFP4(*w)), x.astype(F32))), (packed, scale), qbytes
    if form in ("f16", "select", "magic"):
        sp = ME._Spec(Bp=1, packed=True, bn=bn, bk=bk, decode=form)
        k = call(functools.partial(_loop_kernel, sp=sp, nw=2, steps=steps), in_specs=[any_] * 4)
        return (lambda w, x: k(*w, *ME._x_views(x[None].astype(F32), True))[0]), \
            (packed.reshape(O, In // G32, 16), scale), qbytes
    if form == "half":
        words = lax.bitcast_convert_type(packed.reshape(O, In // 8, 4), jnp.int32).reshape(O, In // G32, 4)
        k = call(functools.partial(_half_kernel, bn=bn, bk=bk, steps=steps), in_specs=[any_] * 3)

        def half(w, x):  # x [In] -> [In/32, 8 (i), 4 (q)]: column 32g + 8q + i, scaled
            xs = (x.astype(F32) * F32(HALF_X_SCALE)).astype(jnp.float16)
            return k(*w, jnp.swapaxes(xs.reshape(In // G32, 4, 8), 1, 2))[0]
        return half, (words, scale), qbytes
    raise KeyError(form)


def chained(f, In: int):
    """CHAIN dependent calls in one jit (each output nudges the next input; one small XLA fusion per call beside
    the GEMV, and the packed forms' own layout of x: their ratios are of the whole call as the step makes it)."""
    def run(w, x):
        for _ in range(CHAIN):
            y = f(w, x)
            x = (x.astype(F32) + F32(1e-6) * jnp.tile(y, -(-In // y.shape[0]))[:In]).astype(x.dtype)
        return x
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=14336)
    ap.add_argument("--cols", type=int, default=3584)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "mxfp4_decode.json"))
    a = ap.parse_args(argv)
    dev = jax.devices()[0]
    interpret = dev.platform == "cpu"
    log = timing.logger(a.json)
    log(f"# MXFP4 GEMV [{a.rows}, {a.cols}] at B = 1 on {dev.device_kind}, jax {jax.__version__}"
        + (" (interpret mode: plumbing, not speed)" if interpret else ""))
    packed, scale, x = case(a.rows, a.cols)
    ref = reference(packed, scale, x)
    rows = []
    for form in FORMS:
        try:
            f, ops, nbytes = build(form, packed, scale, interpret=interpret)
            y = np.asarray(jax.jit(f)(ops, x), np.float64)
            err = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
            us = timing.per_call(chained(f, a.cols), (ops, x), reps=1 if interpret else REPS,
                                 inner=1 if interpret else INNER, chain=CHAIN) * 1e6
        except Exception as e:  # noqa: BLE001  (a form that fails to compile is a row, not the end of the run)
            log(f"{form:<10} FAILED {type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(form=form, error=str(e)[:300]))
            continue
        rows.append(dict(form=form, us=us, bytes=nbytes, GBps=nbytes / us / 1e3, rel_err=err))
    base = next((r["us"] for r in rows if r["form"] == "f16" and "us" in r), None)
    for r in rows:
        if "us" in r:
            log(f"{r['form']:<10} {r['us']:9.2f} us  {r['GBps']:7.0f} GB/s  x f16 {base / r['us'] if base else 0:5.2f}"
                f"  rel err {r['rel_err']:.1e}")
    json.dump(dict(device=dev.device_kind, jax=jax.__version__, rows_cols=[a.rows, a.cols], rows=rows),
              open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
