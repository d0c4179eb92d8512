"""`moe_experts`' two kernels at one token (or up to 8) for MXFP4 experts as CUDA kernels through the FFI, on the
tensor cores (mma.sync m16n8k16, float16 in, float32 sums; the shared warp products in ffi/cuda_mxfp4.h):
  `gate_up` (ffi/cuda_mxfp4_gate_up.cu, `jaxk3_mxfp4_gate_up`): a[u, 0, :] = act(W1[ids[u]] x, W3[ids[u]] x), bf16;
  `down` (ffi/cuda_mxfp4_down.cu, `jaxk3_mxfp4_down`): y[p, 0, :] = Σ over part p's slots of coef[u] W2[ids[u]] a[u],
  fp32 partial sums (off: `moe_experts.CUDA_DOWN` says why).

Why CUDA: at one token the Pallas kernel multiplies element-wise on the CUDA cores, ~5.7 instructions a weight
(offline SASS count, `scripts/sass_loop.sh`), and its tensor-core forms lose there, because Triton's layouts for
decoded operands go through shared memory (docs/PERF.md, seventeenth and eighteenth sessions).  Here each lane decodes
its own 32-bit words straight into mma's A-fragment registers: ~3.3 instructions a weight.

The arithmetic is the Pallas float16 form's (`moe_experts.Config.f16`): it needs the stacks marked `MXFP4.f16` (every
E8M0 scale in `moe_experts.F16_SCALES`, checked at load), and each token (or slot's activations) in float16 times a
power of two (`moe_experts.f16_scaled`), exact from 2^-17 of its largest magnitude up.  The kernels want those inputs
in their lanes' order: within each 8, [0, 4, 2, 6, 1, 5, 3, 7] (`PERM`: a 32-bit word's codes as the kernels pair them).
Either XLA makes that copy (float16 in, with 2^-k), or, in the raw form (`moe_experts.Config.cuda_raw`), the kernel
takes the bf16 input as it is and makes the same copy in shared memory (ffi/cuda_mxfp4.h; the same bits:
tests/test_kernels.py's `test_mxfp4_cuda_raw_input_is_f16_scaled` runs that code on the CPU).  `l2` asks L2 for the
whole 256-byte block around each weight load (PTX's L2::256B); values unchanged.  `stages` (0: the register form)
streams the weights through a ring of that many iterations in shared memory (cp.async) in persistent CTAs, each taking
several items with its loads running on across them: kernel 1's items (slot, 16-row block) with the same products in
the same order (the same bits), kernel 2's (part, 16-row block) at one token with the 4 warps splitting each slot's I
(another sum order; one slot a part in `moe_experts`, so the items are many); ffi/cuda_mxfp4_gate_up.cu and
cuda_mxfp4_down.cu say why; `moe_experts.CUDA_STAGES` / `CUDA_STAGES_WIDE` take 4 and 8 for kernel 1 at one token
and at 2-8 (timed, docs/PERF.md).  The wide form takes 1 to 8 tokens (`moe_experts.Config.cuda_wide`): the mma's N
is 8, so lane g of the B fragment reads token g's float16 row (from global memory, kept in L1; the weight loads skip
L1), for the same MMAs and weight bytes as one token.  The defaults
(measured on an H200 and an H100, `moe_experts.CUDA_*`): kernel 1 in CUDA, from XLA's float16 copy at one token and
the wide form at 2 to 8, both in their streaming forms (4 and 8 stages), with the L2 hint; kernel 2 in Pallas.

jnp has no such kernels: the CPU path and the oracle are `moe_experts.experts_partial`, as for the Pallas kernels.
"""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxk3 import _compat

ABI = 6  # the calling convention these wrappers use: ffi/targets.h's JAXK3_CUDA_KERNELS_ABI (the extension reports it)
TARGET = "jaxk3_mxfp4_gate_up"
DOWN_TARGET = "jaxk3_mxfp4_down"
PERM = (0, 4, 2, 6, 1, 5, 3, 7)  # the kernel's order of a word's eight codes (and so of each 8 inputs)
ACTS = {"silu": 0, "situ": 1}
ROWS, IN_MULTIPLE = 16, 256  # I a multiple of ROWS (a CTA's rows), In of IN_MULTIPLE (two halves of 128-code chunks)
MAX_IN = 16384  # the token in shared memory (In x 2 bytes: the handler's kMaxIn)
CHUNK, DOWN_SMEM = 128, 47 * 1024  # `down`: I a multiple of CHUNK; a part's activations (slots x I x 2 bytes) at most
MAX_TOKENS = 8  # the wide form: the mma's N
STAGES = (0, 4, 6, 8)  # the kernels' `stages`: 0 the register form, else the streaming form's ring depth (its instances)
MAX_STREAM_SLOTS = 512  # the streaming form keeps the slots' experts in shared memory (the handler's kMaxStreamSlots)


_lock = threading.Lock()
_found: list[dict] = []  # once: {target: None} for each registered, or {"": why none can run}


def _register(target: str) -> str | None:
    """Registers the extension's CUDA kernels (its `cuda_kernels` list: jaxk3.collectives registers its own targets,
    and kernels and collectives do not import each other) with XLA once, each found target on its own; why `target`
    cannot run, or None."""
    with _lock:
        if not _found:
            why, caps = None, {}
            try:
                from jaxk3 import _ffi  # type: ignore[attr-defined]
            except Exception as e:  # ImportError, or an ABI problem
                why = f"the jaxk3._ffi extension failed to import ({type(e).__name__}: {e})"
            else:
                caps = dict(_ffi.cuda_kernels()) if hasattr(_ffi, "cuda_kernels") else {}
                abi = getattr(_ffi, "cuda_kernels_abi", 1)
                if caps and abi != ABI:  # a build from before (or after) a change to a kernel's operands
                    why = (f"the extension's CUDA kernels take calling convention {abi}, this code calls {ABI} (an "
                           f"extension built from another version)")
            if why is None:
                for name, cap in caps.items():
                    jax.ffi.register_ffi_target(name, cap, platform="CUDA")
            _found.append({t: why for t in caps} if why is None else {"": why})
        got = _found[0]
        return got[target] if target in got else got.get("", "the extension was built without it (no CUDA, or older)")


def unavailable(target: str = TARGET) -> str | None:
    """Why CUDA kernel `target` (TARGET, DOWN_TARGET) cannot run on the traced step's devices (None: it can)."""
    platform = _compat.device_platform()
    if platform != "gpu":
        return f"{target} is a CUDA kernel, the device is {platform!r}"
    why = _register(target)
    return None if why is None else f"{target} cannot run: {why} (`make build` with nvcc rebuilds it)"


def shape_problem(I: int, In: int) -> str | None:
    """Why the kernel's tiling does not divide these experts, or its input does not fit (None: it does)."""
    if I % ROWS or In % IN_MULTIPLE or In > MAX_IN:
        return (f"{TARGET} needs the experts' I a multiple of {ROWS} and input width a multiple of {IN_MULTIPLE} up "
                f"to {MAX_IN}, got I {I}, In {In}")
    return None


def stream_problem(stages: int, U: int, raw: bool, target: str = TARGET) -> str | None:
    """Why kernel `target` (TARGET, DOWN_TARGET) cannot take `stages` for U slots (None: it can; 0 always can)."""
    if stages not in STAGES:
        return f"{target}: stages must be one of {STAGES} (0: the register form), got {stages}"
    if stages and (raw or U > MAX_STREAM_SLOTS):
        return (f"{target}: the streaming form (stages {stages}) takes XLA's float16 copies (not the raw form) and at "
                f"most {MAX_STREAM_SLOTS} slots, got {U} slots{', raw' if raw else ''}")
    return None


def lanes_order(x16: jax.Array) -> jax.Array:
    """Float16 inputs [..., In] (a token, or each slot's activations) in the kernels' order: each 8 permuted by PERM."""
    return x16.reshape(*x16.shape[:-1], -1, 8)[..., np.asarray(PERM)].reshape(x16.shape)


def _x_in(x, inv, lead: int) -> tuple[jax.Array, jax.Array]:
    """A kernel's input and its 2^-k: bf16 as it is with `inv` None (the kernel scales and permutes it in shared
    memory: the "raw" form, no XLA fusion before the call; the buffer for 2^-k is then a constant 1 it does not read),
    or float16 times 2^k (`moe_experts.f16_scaled`) with 2^-k (`lead` values: one per row), permuted here."""
    if inv is None:
        if x.dtype != jnp.bfloat16:
            raise ValueError(f"an input without its 2^-k is taken as it is and must be bfloat16, got {x.dtype}")
        return x, jnp.ones((lead,), jnp.float32)
    return lanes_order(x.astype(jnp.float16)), jnp.reshape(inv, (lead,)).astype(jnp.float32)


def gate_up(ids_U: jax.Array, x: jax.Array, xinv: jax.Array | None, gate, up, up_off: int, I: int, act: str,
            beta: float, linear_beta: float, l2: bool = False, rows: int | None = None, stages: int = 0,
            ctas: int = 0) -> jax.Array:
    """a [U, 1, I] bf16 for one token (the wide form: [U, rows, I] for up to 8): `gate` and `up` the MXFP4 stacks
    (`moe_experts.MXFP4`: packed [E, R, In/2], scale [E, R, In/32]) holding the gate rows [0, I) and the up rows
    [up_off, up_off + I) (the serving layout's join: the same stack twice, up_off = I); x the bf16 token [In] as it is
    with xinv None (the kernel makes its float16 copy), or in float16 times 2^k with xinv = 2^-k (its order as it is:
    permuted here).  x [nb, In] (1 to 8
    tokens, float16, xinv [nb]: the wide form, each lane g reading token g's row): a [U, rows, I] (rows >= nb, the
    rows past nb zeros).  `l2`: the weight loads with L2's 256-byte prefetch size.  `stages` (4, 6, 8): the streaming
    form (its copies always ask for the 256-byte blocks), not with the raw form; 0 the register form; `ctas` > 0 caps
    its grid (the tests', so that each CTA takes many items; 0: as many as fit the GPU at once)."""
    U, In = ids_U.shape[0], x.shape[-1]
    why = shape_problem(I, In) or stream_problem(stages, U, xinv is None)
    if why:
        raise ValueError(why)
    if act not in ACTS:
        raise ValueError(f"{TARGET}: activation {act!r} is not one of {sorted(ACTS)}")
    wide = x.ndim == 2
    nb = x.shape[0] if wide else 1
    R = (rows or nb) if wide else 1  # the output's rows
    if wide and (xinv is None or not 1 <= nb <= R <= MAX_TOKENS):
        raise ValueError(f"{TARGET}: the wide form takes 1 to {MAX_TOKENS} float16 tokens with their 2^-k and at most "
                         f"{MAX_TOKENS} output rows, got x {x.shape}, rows {rows}")
    xs, inv = _x_in(x, xinv, nb)
    out = jax.ShapeDtypeStruct((U, R, I), jnp.bfloat16)
    return jax.ffi.ffi_call(TARGET, out)(
        ids_U.astype(jnp.int32), xs, inv, gate.packed, gate.scale, up.packed, up.scale, up_off=np.int64(up_off),
        act=np.int64(ACTS[act]), beta=np.float32(beta), linear_beta=np.float32(linear_beta), l2=np.int64(bool(l2)),
        stages=np.int64(stages), ctas=np.int64(ctas))


def down_problem(U: int, I: int, Out: int, parts: int, wide: bool = False, stream: bool = False) -> str | None:
    """Why `down`'s tiling does not divide these experts or its parts' activations do not fit (None: they do; the wide
    and streaming forms keep no part's activations in shared memory)."""
    if I % CHUNK or Out % ROWS or not 1 <= parts <= 65535:
        return (f"{DOWN_TARGET} needs I a multiple of {CHUNK}, Out of {ROWS} and 1 to 65535 slot parts, got I {I}, "
                f"Out {Out}, {parts} parts")
    per = -(-U // parts)
    if not wide and not stream and per * (I * 2 + 4) > DOWN_SMEM:  # (and each slot's 2^-k in the raw form)
        return f"{DOWN_TARGET}: a part's {per} slots of {I} activations exceed {DOWN_SMEM} bytes of shared memory"
    return None


def down(ids_U: jax.Array, coef: jax.Array, a: jax.Array, ainv: jax.Array | None, w2, parts: int,
         l2: bool = False, stages: int = 0, ctas: int = 0) -> jax.Array:
    """y [parts, 1, Out] fp32: part p's sum over its slots [p·per, min((p+1)·per, U)) (per = ceil(U / parts)) of
    coef[u] · W2[ids[u]] a[u]; `w2` the MXFP4 stack (packed [E, Out, I/2], scale [E, Out, I/32]); a [U, I] each slot's
    activations, bf16 as they are with ainv None (the kernel scales each slot), or in float16 times 2^k_u with ainv
    [U] = 2^-k_u (their order as it is: permuted here); coef [U].  The wide form: a [U, nb, I] float16 (1 to 8
    tokens' rows, each times its 2^k), ainv [U, nb], coef [nb, U] (each token's weight of each slot, 0 where it did
    not choose it): y [parts, nb, Out].  `l2`: the weight loads with L2's 256-byte prefetch size.  `stages` (4, 6, 8):
    the streaming form at one token (persistent CTAs over (part, 16-row block) items, the 4 warps splitting each slot's
    I, the codes and activations through a ring in shared memory; its sums in another order than the register
    form's), float16 activations only; `ctas` > 0 caps its grid (the tests')."""
    wide = a.ndim == 3
    U, I = a.shape[0], a.shape[-1]
    nb = a.shape[1] if wide else 1
    Out = w2.packed.shape[1]
    why = (down_problem(U, I, Out, parts, wide, stream=bool(stages))
           or stream_problem(stages, U, ainv is None, DOWN_TARGET) or (
               f"{DOWN_TARGET}: the streaming form takes one token's activations, got a {a.shape}"
               if stages and wide else None))
    if why:
        raise ValueError(why)
    if wide and (ainv is None or not 1 <= nb <= MAX_TOKENS):
        raise ValueError(f"{DOWN_TARGET}: the wide form takes 1 to {MAX_TOKENS} tokens' float16 rows with their "
                         f"2^-k, got a {a.shape}")
    xs, inv = _x_in(a, ainv, U * nb)
    out = jax.ShapeDtypeStruct((parts, nb, Out), jnp.float32)
    return jax.ffi.ffi_call(DOWN_TARGET, out)(
        ids_U.astype(jnp.int32), jnp.reshape(coef, (nb * U,)).astype(jnp.float32), xs, inv, w2.packed, w2.scale,
        l2=np.int64(bool(l2)), stages=np.int64(stages), ctas=np.int64(ctas))
