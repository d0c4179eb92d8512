"""One token's bf16 GEMVs as CUDA kernels through the FFI: `gemv` (ffi/cuda_bf16_gemv.cu, `jaxk3_bf16_gemv`: the decode
GEMV with its optional RMSNorm prologue, and `gemv_gnorm`, `jaxk3_bf16_gemv_gnorm`, with KDA's gated per-head norm:
`jaxk3.kernels.gemv.CUDA`), and `moe_experts`' two kernels for bf16 experts
(ffi/cuda_bf16_experts.cu):
  `gate_up` (`jaxk3_bf16_gate_up`): a[u, 0, :] = act(W1[e_u] x, W3[e_u] x) in bf16 for the slots' experts e_u, and
            with the shared experts one more slot of theirs; the experts given (ids and weights), or ranked from the
            router's logits in every CTA (`route`: sigmoid, + bias, top-k in lax.top_k's order, renormalised, scaled,
            as `router.select_experts`), and written out with their weights for `down`;
  `down`    (`jaxk3_bf16_down`): y[0, :] = Σ_u coef[u] · W2[e_u] a[u] (+ the shared experts' down of their slot), fp32,
            one sum (no partial sums for XLA to add); with `residual` (the block's residual stream h [1, Out] bf16),
            bf16(h + y) instead: the residual add in its epilogue, XLA's add and rounding bit for bit.

Why CUDA: at one token the Pallas kernels stream Kimi-Linear-48B's experts at 3.0-3.2 TB/s in 576-program grids of
[16, 256] tiles (docs/PERF.md); here each warp owns one output (a gate | up row pair, or one down row over all the
slots), issues all of a row pair's 16-byte loads (up to 10 a lane a row) before its first product, and the CTAs are
persistent, each warp striding over the outputs.  Sums are float32 in the lanes' order (8-wide vectors, then a
butterfly of shuffles): the reference's values to float32 rounding (`moe_experts.experts_partial`), not its bits.

Off by default (`moe_experts.CUDA_BF16`, `gemv.CUDA`): in the 48B B = 1 step slower than the Pallas kernels in every
form timed (docs/PERF.md, twenty-sixth session).  jnp has no such kernels: the CPU path and the
oracle are `moe_experts.experts_partial` (and `routed_reference`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxk3.kernels import mxfp4_cuda as CU

GATE_UP = "jaxk3_bf16_gate_up"
DOWN = "jaxk3_bf16_down"
GEMV = "jaxk3_bf16_gemv"  # (ffi/cuda_bf16_gemv.cu) the decode GEMV at one token, `gemv.CUDA`
GEMV_GNORM = "jaxk3_bf16_gemv_gnorm"  # (the same file) with KDA's gated per-head norm first, `gemv.CUDA`
# Which of each kernel's two handlers the calls name: False, the one XLA launches between its command buffers; True,
# the `_cb` one inside them (kCmdBufferCompatible), captured into a child graph and updated whenever a buffer it
# touches has moved, which made the 48B B = 1 step host-paced on an H100 with ~100 such calls a step (docs/PERF.md,
# twenty-fifth session).  Outside them the step was slower still (303 us against 155, twenty-sixth session).
COMMAND_BUFFER = False
# Whether the calls launch their kernels as programmatic dependent launches (`pdl` 1), as XLA launches every kernel of
# the step (docs/PERF.md, ninth session): then a kernel is launched while the one before it ends and waits in
# `griddepcontrol.wait` for its writes (the GEMVs after issuing their first weight loads, which nothing writes);
# launched plainly (0), it is not launched before the kernel ahead of it in the stream has finished.  ~100 calls a step
# at one token, a few microseconds each: a candidate for the CUDA kernels' loss in the 48B step (twenty-sixth session),
# not yet timed.
PDL = False
MAX_SLOTS = 64  # routed slots + the shared experts' (the handlers' kMaxSlots)
MAX_EXPERTS = 1024  # ranked in shared memory (kMaxExperts)
MAX_IN = 16384  # the token in shared memory (kMaxIn)
DOWN_I = (256, 512, 1024, 2048)  # down: I / 256 vectors a lane, one instance each
DOWN_SMEM = 96 * 1024  # down: the slots' activations in shared memory (kMaxDownSmem)


def target(name: str) -> str:
    """The FFI target a call of kernel `name` (GATE_UP, DOWN, GEMV, GEMV_GNORM) names: its handler inside XLA's
    command buffers (`name` + "_cb") where COMMAND_BUFFER is set, else the one outside them."""
    return name + "_cb" if COMMAND_BUFFER else name


def unavailable() -> str | None:
    """Why the two kernels cannot run on the traced step's devices (None: they can)."""
    return CU.unavailable(target(GATE_UP)) or CU.unavailable(target(DOWN))


def problem(E: int, U: int, I: int, In: int, shared: bool, routed: bool) -> str | None:
    """Why the kernels do not take experts of these dims (None: they do)."""
    P = U + shared
    if not 1 <= U or P > MAX_SLOTS:
        return f"{GATE_UP}: 1 to {MAX_SLOTS} slots with the shared experts', got {U} routed + {int(shared)}"
    if In % 256 or In > MAX_IN:
        return f"{GATE_UP}: the input width must be a multiple of 256 up to {MAX_IN}, got {In}"
    if routed and E > MAX_EXPERTS:
        return f"{GATE_UP}: ranks at most {MAX_EXPERTS} experts' logits, got {E}"
    if I not in DOWN_I or P * I * 2 > DOWN_SMEM:
        return (f"{DOWN}: I must be one of {DOWN_I} and the slots' activations at most {DOWN_SMEM} bytes, got I {I}, "
                f"{P} slots")
    return None


def gate_up(sel0: jax.Array, sel1: jax.Array, x: jax.Array, gate: jax.Array, up: jax.Array, up_off: int, I: int,
            shared: jax.Array | None, act: str, beta: float, linear_beta: float,
            route: tuple[int, bool, float] | None = None, ctas: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(a [P, 1, I] bf16, ids [U] int32, coef [U] float32) for one bf16 token x [In]: `gate` and `up` the experts'
    stacks [E, rows, In] (the serving layout's join: the same stack, up_off = I); `shared` the shared experts' gate | up
    [2 I, In] (slot U) or None.  `route` None: sel0 the slots' experts [U] int32 and sel1 their weights [U] (passed
    through to ids and coef); (k, renorm, scale): sel0 the router's logits [E] and sel1 its selection bias [E], float32,
    k slots ranked by the kernel.  `ctas` > 0 caps the grid (the tests': each warp then takes many outputs)."""
    E, In = gate.shape[0], x.shape[-1]
    U = route[0] if route else sel0.shape[0]
    why = problem(E, U, I, In, shared is not None, route is not None)
    if why:
        raise ValueError(why)
    if act not in CU.ACTS:
        raise ValueError(f"{GATE_UP}: activation {act!r} is not one of {sorted(CU.ACTS)}")
    if x.ndim != 1 or x.dtype != jnp.bfloat16 or gate.dtype != jnp.bfloat16 or up.dtype != jnp.bfloat16:
        raise ValueError(f"{GATE_UP}: one bf16 token [In] and bf16 experts, got x {x.shape} {x.dtype}, experts "
                         f"{gate.dtype}, {up.dtype}")
    k, renorm, scale = route or (0, False, 1.0)
    if route:
        sel0, sel1 = jnp.reshape(sel0, (E,)).astype(jnp.float32), jnp.reshape(sel1, (E,)).astype(jnp.float32)
    else:
        sel0, sel1 = sel0.astype(jnp.int32), jnp.reshape(sel1, (U,)).astype(jnp.float32)
    P = U + (shared is not None)
    outs = (jax.ShapeDtypeStruct((P, 1, I), jnp.bfloat16), jax.ShapeDtypeStruct((U,), jnp.int32),
            jax.ShapeDtypeStruct((U,), jnp.float32))
    return jax.ffi.ffi_call(target(GATE_UP), outs)(
        sel0, sel1, x, gate, up, gate if shared is None else shared, up_off=np.int64(up_off),
        act=np.int64(CU.ACTS[act]), beta=np.float32(beta), linear_beta=np.float32(linear_beta),
        shared=np.int64(shared is not None), route_k=np.int64(k), renorm=np.int64(bool(renorm)),
        scale=np.float32(scale), ctas=np.int64(ctas), pdl=np.int64(PDL))


def down(ids: jax.Array, coef: jax.Array, a: jax.Array, w2: jax.Array, shared: jax.Array | None,
         residual: jax.Array | None = None, ctas: int = 0) -> jax.Array:
    """y [1, Out] fp32 = Σ_u coef[u] · W2[ids[u]] a[u, 0] (+ shared a[U, 0] with the shared experts' down [Out, I]):
    a [P, 1, I] bf16 (`gate_up`'s), w2 [E, Out, I] bf16, ids [U] int32 (an id outside [0, E) skips its slot), coef [U]
    float32.  With `residual` h [1, Out] bf16: bf16(h + y) [1, Out].  `ctas` > 0 caps the grid (the tests')."""
    U, (P, _, I), (E, Out, _) = ids.shape[0], a.shape, w2.shape
    why = problem(E, U, I, 256, shared is not None, False)
    if why or P != U + (shared is not None) or a.dtype != jnp.bfloat16 or w2.dtype != jnp.bfloat16:
        raise ValueError(why or f"{DOWN}: bf16 activations [U + shared, 1, I] and experts, got a {a.shape} {a.dtype}, "
                                f"{U} ids, experts {w2.dtype}")
    if residual is not None and (residual.size != Out or residual.dtype != jnp.bfloat16):
        raise ValueError(f"{DOWN}: the residual must be bf16 [1, {Out}], got {residual.shape} {residual.dtype}")
    out = jax.ShapeDtypeStruct((1, Out), jnp.float32 if residual is None else jnp.bfloat16)
    return jax.ffi.ffi_call(target(DOWN), out)(
        ids.astype(jnp.int32), jnp.reshape(coef, (U,)).astype(jnp.float32), a, w2, w2 if shared is None else shared,
        w2 if residual is None else jnp.reshape(residual, (Out,)), shared=np.int64(shared is not None),
        residual=np.int64(residual is not None), ctas=np.int64(ctas), pdl=np.int64(PDL))


def gemv_problem(x: jax.Array, w: jax.Array, norm_w: jax.Array | None = None) -> str | None:
    """Why `gemv` does not take this call (None: it does): one row, bf16 weights [N, K] with K a multiple of 256 up to
    MAX_IN, the token bf16 where it is normed."""
    if x.ndim != 2 or x.shape[0] != 1 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        return f"{GEMV}: one row x [1, K] and weights [N, K], got x {x.shape}, w {w.shape}"
    if w.shape[0] < 1 or w.dtype != jnp.bfloat16 or (norm_w is not None and (
            x.dtype != jnp.bfloat16 or norm_w.shape != (w.shape[1],) or norm_w.dtype != jnp.bfloat16)):
        return (f"{GEMV}: bf16 weights [N >= 1, K], and with the norm a bf16 token and a bf16 [K] norm weight, got w "
                f"{w.shape} {w.dtype}, x {x.dtype}{'' if norm_w is None else f', norm {norm_w.shape} {norm_w.dtype}'}")
    if w.shape[1] % 256 or w.shape[1] > MAX_IN:
        return f"{GEMV}: K must be a multiple of 256 up to {MAX_IN}, got {w.shape[1]}"
    return None


def gemv(x: jax.Array, w: jax.Array, norm_w: jax.Array | None = None, eps: float = 0.0, ctas: int = 0) -> jax.Array:
    """fp32 [1, 1, N] = xn @ W^T for one token x [1, K] and bf16 W [N, K] (the one partial sum `gemv.partials` gives):
    xn = x in bf16, or with `norm_w` RMSNorm(x; norm_w, eps) in bf16 (`rms_norm_as`), made by every CTA in its
    prologue.  `ctas` > 0 caps the grid (the tests').  With `PDL` the kernel loads its first rows of `w` before it waits
    for the kernels ahead: `w` must be written by none of the step's kernels (a parameter, not a slice or a cast)."""
    why = gemv_problem(x, w, norm_w)
    if why:
        raise ValueError(why)
    N, K = w.shape
    # (not read without the norm: x itself, not a slice of w, which XLA would wrap the call in a slicing fusion for)
    g = x.astype(jnp.bfloat16) if norm_w is None else norm_w
    return jax.ffi.ffi_call(target(GEMV), jax.ShapeDtypeStruct((1, 1, N), jnp.float32))(
        x.astype(jnp.bfloat16), w, g, norm=np.int64(norm_w is not None), eps=np.float32(eps), ctas=np.int64(ctas),
        pdl=np.int64(PDL))


def gnorm_problem(x: jax.Array, z: jax.Array, norm_w: jax.Array, w: jax.Array, dt) -> str | None:
    """Why `gemv_gnorm` does not take this call (None: it does): one float32 row of x and z [1, K], a float32 norm
    weight of d values (a multiple of 32 dividing K), bf16 weights [N, K] with K a multiple of 256 up to MAX_IN, and
    the normed row cast to bf16 (`dt`)."""
    if x.ndim != 2 or x.shape[0] != 1 or z.shape != x.shape or w.ndim != 2 or x.shape[1] != w.shape[1]:
        return f"{GEMV_GNORM}: one row of x and z [1, K] and weights [N, K], got x {x.shape}, z {z.shape}, w {w.shape}"
    K, d = w.shape[1], (norm_w.shape[0] if norm_w.ndim == 1 else 0)
    if x.dtype != jnp.float32 or z.dtype != jnp.float32 or norm_w.dtype != jnp.float32 or w.dtype != jnp.bfloat16 \
            or jnp.dtype(dt) != jnp.bfloat16:
        return (f"{GEMV_GNORM}: float32 x, z and norm weight, bf16 weights and a bf16 normed row, got x {x.dtype}, z "
                f"{z.dtype}, norm {norm_w.dtype}, w {w.dtype}, dt {jnp.dtype(dt)}")
    if K % 256 or K > MAX_IN or d < 32 or d % 32 or K % d:
        return (f"{GEMV_GNORM}: K a multiple of 256 up to {MAX_IN} of whole heads of d (a multiple of 32), got K {K}, "
                f"norm {norm_w.shape}")
    return None


def gemv_gnorm(x: jax.Array, z: jax.Array, norm_w: jax.Array, eps: float, w: jax.Array, ctas: int = 0) -> jax.Array:
    """fp32 [1, 1, N] = xn @ W^T, xn = bf16(gated_rms_norm(x; norm_w, z) over each head of d = len(norm_w) values)
    (`gemv.gnorm_reference`'s function), made by every CTA in its prologue: x and z [1, K] float32 (KDA's core output
    and gate), W [N, K] bf16.  `ctas` > 0 caps the grid (the tests').  With `PDL`, as `gemv`: W a parameter of the
    step."""
    why = gnorm_problem(x, z, norm_w, w, jnp.bfloat16)
    if why:
        raise ValueError(why)
    return jax.ffi.ffi_call(target(GEMV_GNORM), jax.ShapeDtypeStruct((1, 1, w.shape[0]), jnp.float32))(
        x, z, norm_w, w, eps=np.float32(eps), ctas=np.int64(ctas), pdl=np.int64(PDL))
