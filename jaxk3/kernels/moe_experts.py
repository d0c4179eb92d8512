"""The experts of a MoE decode step (routed, and the shared experts where they read the same input) as
two Pallas kernels over the *distinct* selected experts, beside their jnp reference `experts_partial`
(and the MXFP4 format and GLU math it uses).

The reference gathers one weight matrix per (token, slot): at batch B with k experts per token it
reads B·k matrices, duplicates included.  Here the B·k choices are reduced to U = min(E, B·k)
distinct experts first (`plan`; at B = 1 the k choices are already distinct), and each selected
expert's rows are read once for the whole batch:

    kernel 1 (gate-up + activation)  a[u, b] = act(W1_u z_b, W3_u z_b)                [P, Bp, I]
    kernel 2 (down + combine)        out_b = Σ_u coef[u, b] · W2_u a[u, b]  (+ W2_s a[s, b])   [S, Bp, L]

P = U, plus one slot for the shared experts when they are given (Kimi-Linear: the routed experts
read the hidden state, as the shared experts do; `shared` must have I intermediate rows per rank).
Kernel 2 walks the P experts inside each program, so the combine, the shared experts' down
projection and their sum with the routed partial cost no kernel of their own; its S programs along I
leave S partial sums that XLA adds in the fusion that consumes the output (the residual add), except at one token
with bf16 experts handed the residual stream, where kernel 2 runs in one part and adds it itself
(`RESIDUAL_IN_DOWN`).

How a tile is multiplied (as in jaxk3.kernels.gemv, whose sweep found the same):
  B = 1        the tile times x, accumulated element-wise in fp32 registers, reduced once at the end;
  B > 1 dense  x padded to 16 rows, `dot` on the tensor cores (bf16 in, fp32 accumulate);
  B > 1 MXFP4  where every scale of the stacks lies in F16_SCALES (checked at load: the config's experts_f16,
               `MXFP4.f16`) each code times its scale is a float16 exactly, and the tokens, scaled per row by a
               power of two, are float16 exactly: one float16 dot per tile (`Config.f16`), the decoded weights the
               MMA's M side (wgmma's A operand, from registers) and the tokens padded to 8 rows (`Config.swap`);
               otherwise x padded to 16 rows and each 32-value scale group's codes in bf16 on the tensor cores, the
               sums times the group's scale (`Config.mx_dot`); per token element-wise where the input is not bf16.
MXFP4 at 1 to 8 tokens, kernel 1 is a CUDA kernel where the extension has it (`Config.cuda`, jaxk3.kernels.mxfp4_cuda:
the float16 form's arithmetic on mma.sync, each lane decoding its own words into its fragment registers; Triton's
layouts made every tensor-core form at one token slower than the element-wise one), by default in its streaming form
(`Config.cuda_stages`: the weights through a ring in shared memory, 4 stages at one token, 8 in the wide form for 2 to
8 tokens); kernel 2 has the same CUDA form, off: slower in the step (`Config.cuda_down`).
MXFP4 rows are dequantised in registers (by default each 32-bit word's eight E2M1 codes become float16's bits in a
few PTX instructions, `Config.decode`, then the E8M0 scale per group) and never exist dequantised in memory.
Products and sums are float32, as in the reference; the sums run in another order, so the results
agree to float32 rounding (tests/test_kernels.py).  Padded slots of `plan` (expert id -1, B > 1) write
zeros in kernel 1; kernel 2 re-reads the last expert's rows for them (just read by the same program, so
from cache) times a zero coefficient, rather than branch inside its loop.

`moe_experts_routed` is the same two kernels handed the router's fp32 logits and bias instead of ids and weights,
so that XLA's selection chain does not run in the step: for one token every program of kernel 1 ranks the logits
itself (lax.top_k's order, by comparison tiles) and its programs (u, 0) write slot u's expert and weight for
kernel 2.  One token only: two forms for B > 1 (every program planning the distinct experts, then one planning
kernel before the two) made the 48B step 23% and 12% slower on an H200 and were removed (docs/PERF.md).
Nor does the block's input norm go into these kernels: two forms (the row normed again in every program of kernel 1;
the router's normed GEMV writing the normed row for kernel 1) took 44 XLA kernels a step away and made the 48B step
3.5% slower, and were removed (seventh session; commit 023775a holds the second).  Nor a kernel of its own before
them: `moe_in` (the residual add of o_proj's partial sums, the input norm and the router's logits in one) took 5.2-6.9
us where XLA's four took 4.1-5.8, and made the step 41-82 us slower in three forms (tenth session; commit 86e1896).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxk3.config import MXFP4_GROUP as G32
from jaxk3.config import KimiK3Config
from jaxk3.kernels import mxfp4_cuda as CU
from jaxk3.kernels.registry import Kernel, dot_nt, pow2, register, triton_params

F32 = jnp.float32


DECODES = ("f16", "asm", "select", "bits")  # Config.decode's choices
MAX_B = 8  # decode rows; more take the reference (prefill has jaxk3.kernels.moe_grouped)
# Config.cuda None: kernel 1 at one token in CUDA where it applies (nineteenth session, H200: K3's TP 2 share 89.4 us for
# both kernels against the Pallas kernel 1's 105.5 and XLA's 182.0; the K3 layers 11-14 B = 1 step 2524.5/2529.7 us
# against 2588.5/2591.6 in the same call; compiled at K3's TP 1, 2, 8 shares and the 48B's, docs/PERF.md)
CUDA_GATE_UP = True
# Config.cuda_down None: kernel 2 in CUDA (jaxk3.kernels.mxfp4_cuda.down).  Off: its compiled tests pass on an H200, and
# alone it is faster than the Pallas kernel 2 at B = 8 (K3's TP 2 share, wide: 278.9 us against 299.1) but not at one
# token (102.2 against 97.6), and the K3 layers 11-14 packed steps were slower with it at both (B = 1: 2611.2 us against
# 2567.4 and 2572.3; B = 8, wide and L2: 3347.1 against 3259.9 without it; twenty-second session, docs/PERF.md)
CUDA_DOWN = False
# Config.cuda_raw / cuda_l2 None: the CUDA kernels' forms (ffi/cuda_mxfp4.h).  raw: each kernel takes its bf16 input as
# it is and makes the float16 copy itself (cp.async into shared memory, the largest magnitude, scaled and permuted in
# place), in place of `f16_scaled` and `lanes_order` as XLA fusions before it; off: even with the measured form on an
# H200 (K3's TP 2 share at B = 1: 99.0 us against 97.6; the K3 layers 11-14 step 2570.5 us against 2567.4 and 2572.3,
# twenty-second session).  l2: the weight loads ask L2 for the whole 256-byte block around each (PTX's L2::256B
# prefetch size); on: K3's TP 2 share 91.1 us against 97.6 at B = 1 and 259.8 against 278.9 at B = 8 (wide, CUDA
# kernel 2), the same bits; the K3 B = 1 step 2514.9 us against 2533.5 and 2518.7 in the same call (docs/PERF.md)
CUDA_RAW = False
CUDA_L2 = True
# Config.cuda_wide None: the CUDA kernels for 2 to 8 tokens (the same products with each token a column of the mma's
# N = 8: lane g reads token g's float16 row through L1), in place of the Pallas float16 forms at B > 1.  On there (K3's
# TP 2 share at B = 8: 299.1 us against the Pallas kernels' 329.2; the K3 layers 11-14 packed B = 8 step 3304.0 us
# against 3390.6 and 3389.8, and with the L2 hint 3259.9 against 3350.3 and 3353.6, twenty-second session); not at one
# token, where the shared-memory copy is faster (97.6 us against 107.6).  Config.cuda_wide=True takes it at one token
CUDA_WIDE = True
# Config.cuda_stages None: kernel 1's streaming form (jaxk3.kernels.mxfp4_cuda's `stages`: persistent CTAs, the weights
# through a ring of that many iterations in shared memory; the same bits as the register form), H100, twenty-seventh
# session, docs/PERF.md.  CUDA_STAGES at one token from XLA's float16 copy (the "f16" form): K3's TP 2 share 88.0 us
# against the register form's 94.7 (6: 86.4, 8: 88.6), the K3 layers 11-14 packed B = 1 step 3218.8-3258.9 us against
# 3242.9-3289.8 in the same calls (6: even).  CUDA_STAGES_WIDE in the wide form (2-8 tokens): K3's TP 2 share at B = 8
# 327.9 us against 343.4 (4 and 6 slower: 361.2, 371.2), the K3 layers 11-14 packed B = 8 step 4162.5 / 4191.6 us
# against 4274.6 / 4268.8 in the same call (B = 2-7 not timed, nor the wide form at one token, Config.cuda_wide=True,
# which takes it too).  Not kernel 2 (with cuda_down its streaming form was slower at every depth: 99.0-100.2 us
# against 91.3): there only an explicit Config.cuda_stages takes it
CUDA_STAGES = 4
CUDA_STAGES_WIDE = 8
# One token, bf16 experts, handed the residual stream (one rank: `layers.moe`'s fold): kernel 2 adds it and rounds,
# writing the new stream bf16(h + out) itself, in one part along I (Config.splits 1; its rows per program cut to keep
# 4 programs an SM: `_fold_config`), instead of S partial sums that an XLA fusion after it adds to h: one launch
# fewer per MoE block.  Thirty-fifth session, 1x H100, the 48B B = 1 step at 4K in two calls (main before and after):
# 2927.1 and 2921.1 us, 237 launches, against main's 2917.5-2938.0 us, 262: even in time, 25 launches fewer (issue 22's
# <= 250); with 256-wide tiles 2954.7, with 8-row programs (288) 2996.8: slower.
RESIDUAL_IN_DOWN = True
FOLD_BK = 1024  # kernel 2's input columns per tile when it adds the residual (at most; Config.down_bk overrides)


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernels' tiling and MXFP4 decode (scripts/gpu/moe_experts_sweep.py times them against XLA)."""
    bn: int = 0  # output rows per program, both kernels but for down_bn (a power of two dividing I and L); 0: _resolve
    bk: int = 0  # input columns per tile (a power of two; MXFP4: bk / 32 scale groups); 0: `_resolve`'s
    down_bn: int = 0  # kernel 2's own output rows per program (a power of two dividing L, >= 4 at one token, else 16);
    # 0: bn, or with the residual added in kernel 2 (`RESIDUAL_IN_DOWN`) the largest power of two <= bn giving >= 4
    # programs an SM
    down_bk: int = 0  # kernel 2's own input columns per tile (a power of two dividing I); 0: bk, or with the residual
    # added in kernel 2 the largest power of two <= FOLD_BK dividing I
    splits: int = 0  # kernel 2's programs along I (partial sums added by the consumer); 0: enough for 4 per SM, or 1
    # where kernel 2 adds the residual stream itself (RESIDUAL_IN_DOWN: no partial sums)
    slot_splits: int = 0  # kernel 2's programs along the slots (each sums a contiguous part of them; more partial
    # sums): for grids that `splits` alone leaves short of the SMs.  0: with `f16`, the fewest (up to 4) giving 8
    # programs an SM, two waves at its 4 resident (seventeenth session, B = 8: K3's TP 2 share, where kernel 2's 336
    # programs filled 0.64 of a wave, 2/3/4 parts 424.9/415.1/415.2 us against 438.8 with one; K3's TP 1 step, 672
    # programs, 2/3 parts 3811.6/3826.3 us against 3891.8; 4 at both with the 256-column tiles since); 4 for MXFP4 at
    # one token (K3's TP 2 share: 672 programs, 0.57 of a wave; 4 parts 101.4 us against one's 110.9, seventeenth
    # session; the K3 TP 1 step 2593.8/2613.3 us against 2657.6/2661.2, eighteenth); else 1
    num_warps: int = 4
    num_stages: int = 0  # Triton's software pipeline; 0: 1 with `f16` (the loads issued in the loop itself: eighteenth
    # session, K3's TP 2 share, B = 8, with bk 256: 323.5/325.1 us against 3 stages' 358.7/352.6 at bk 128; the K3 B = 8
    # step 3389.0/3390.5 us against 3617.5/3625.8), else 3
    decode: str = "asm"  # MXFP4's E2M1 -> float: "asm" (float16's bits built by PTX, eight codes from one 32-bit
    # word, `_ASM_LO`/`_ASM_HI`; interpret mode runs "f16", the same values: the fastest on the H200, sixteenth
    # session: K3's TP 2 share 119.6 us against "f16"'s 141.2 at B = 1 and 595.2 against 658.5 at B = 8, bitwise the
    # same output), "f16" (the same bits by Triton's integer operations, then a conversion), "select" (compares and
    # selects) or "bits" (the scaled float's bits).  A decode with no float conversion
    # (a 32-bit lookup under 2^22's exponent, commit 23ec581) was 16-19% slower than "f16" (docs/PERF.md, thirteenth
    # session): the conversions are not what bounds it.
    # MXFP4 only (docs/PERF.md, thirteenth session: the generated loop, compiled offline, spends ~12 instructions per
    # weight where bf16's spends ~4, two of them the products by 2^14 and by the scale, one the input's widening):
    scale: str = ""  # "weight": each decoded value times its group's scale; "group": each 32-value group's
    # products summed first, then times 2^14 and the scale once ("f16" and "select" decodes): the same exact
    # products summed in another order (float32 reassociation, as the tiles already are).  "": "group" for one token,
    # "weight" for more (fourteenth session, K3's TP 2 share: 145.2 us against 187.9 and XLA's 182.1 at B = 1, and
    # 2633.5 against 1795.0 at B = 8)
    x_f32: bool | None = None  # the input passed as float32 (XLA widens it once) instead of widened in the loop:
    # the same values, bitwise the same results.  None: with the "group" scale (measured together)
    mx_dot: bool | None = None  # MXFP4 for more than one token on the tensor cores: the tokens padded to 16 rows,
    # each scale group's decoded codes (bf16, exact) in two [16, 16] x [16, bn] dots, their sum times the group's
    # scale (`_mx_dot_rows`).  None: on for MXFP4 with B > 1 and bf16 activations not widened ("f16" or "select"
    # decode), where the element-wise form reduces each token's products per tile (fifteenth session, K3's TP 2
    # share, B = 8: 665.3 us at bn 128, 819.7 at bn 64, against the element-wise 1800.3 and XLA's 1224.7)
    f16: bool | None = None  # MXFP4 on float16 tensor cores (`_f16_dot_rows`): each code times its group's scale is
    # a float16, exactly, for E8M0 bytes in F16_SCALES (PTX's mul.rn.f16x2 of the "asm" decode's bits); the bf16 tokens
    # scaled per row by a power of two into float16 (exact from 2^-17 of the row's maximum up: `_f16_views`); one dot
    # per tile, no per-group rescale.  None: on for B > 1 with bf16 activations where the stacks are marked
    # (`MXFP4.f16`, from the config's experts_f16, set at load), before mx_dot (seventeenth session, K3's TP 2 share,
    # B = 8: 425.2 us against mx_dot's 590.6 and XLA's 1203.6); off at B = 1, where it lost to the scale per group
    # (164.1 us against 122.0)
    swap: bool | None = None  # the B > 1 dot as the weights [bn, bk] (the MMA's M side: Hopper's wgmma, `f16`'s
    # decoded weights from registers) times the tokens [bk, Bp], the tokens padded to 8 rows (wgmma's N) instead of 16
    # (the M side of mma.sync).  None: on with `f16` (eighteenth session, K3's TP 2 share, B = 8: 355.2 us against
    # 404.4; the K3 B = 8 step 3597.9 us against 3792.8); for bf16 experts at B > 1 where the input is at most 2304
    # wide (nineteenth session: Kimi-Linear-48B B = 8 alone 194.0 us against 211.4 and XLA's 263.5, the step 6616.2
    # against 6941.0; K3's TP 2 share even, 530.8 against 529.5, so not there)
    cuda: bool | None = None  # MXFP4 at one token: kernel 1 (gate | up and the GLU) as the CUDA kernel
    # (jaxk3.kernels.mxfp4_cuda: mma.sync on float16, each lane decoding into its own fragment registers), kernel 2
    # as it is.  For stacks marked `MXFP4.f16`, bf16 activations, no shared experts in the kernels, the jaxk3
    # extension built with CUDA.  None: CUDA_GATE_UP where it applies; True: `fits` refuses a call where it cannot run
    # (saying why); a direct `experts` call, and interpret mode, then take the Pallas kernel 1
    cuda_down: bool | None = None  # the same for kernel 2 (down and the combine; the slots in `slot_splits` parts), its
    # input each slot's activations in float16 times a power of two (one XLA fusion).  None: CUDA_DOWN where it applies
    cuda_raw: bool | None = None  # the CUDA kernels' inputs (the token; each slot's activations) passed as bf16 as they
    # are, each kernel making its float16 copy in shared memory (the same values: `f16_scaled`'s, the lanes' order),
    # with no XLA fusion before it; one token, and not with `cuda_wide` (which takes precedence).  None: CUDA_RAW
    cuda_l2: bool | None = None  # the CUDA kernels' weight loads with L2's 256-byte prefetch size.  None: CUDA_L2
    cuda_wide: bool | None = None  # the CUDA kernels for 1 to 8 tokens (each token one of the mma's 8 columns, its
    # float16 row read through L1, nothing copied to shared memory; the tokens' and activations' float16 copies made by
    # XLA): at B > 1 in place of the Pallas kernels' float16 form, at one token in place of the shared-memory copy.
    # None: CUDA_WIDE
    cuda_stages: int | None = None  # the CUDA kernels streaming their weights through a ring of 4, 6 or 8 iterations in
    # shared memory (persistent CTAs; 0: the register form): kernel 1 in every form but cuda_raw, kernel 2 (with
    # cuda_down) at one token from XLA's float16 copies, one slot a part.  None: kernel 1's CUDA_STAGES at one token
    # from XLA's float16 copy, CUDA_STAGES_WIDE in the wide form, the register form elsewhere


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SharedMLP:
    """The shared experts' weights on this rank, in the serving layout (jaxk3.layers.moe.MLPWeights'
    gate_up_proj and down_proj): `gate_up` [2·Is, In] (gate rows, then up rows), `down` [Out, Is]."""
    gate_up: jax.Array
    down: jax.Array


# ---------------------------------------------------------------- the jnp math (reference and CPU path)
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MXFP4:
    """A stack of MXFP4 matrices W [E, O, In] (compressed-tensors `mxfp4-pack-quantized`, jaxk3.mxfp4):
    `packed` uint8 [E, O, In/2] (byte j: low nibble = column 2j, high = 2j+1) and `scale` uint8
    [E, O, In/32] (E8M0, bias 127), sharded alike (a split of In splits whole scale groups)."""
    packed: jax.Array
    scale: jax.Array
    # static: every scale byte lies in F16_SCALES, so each weight is a float16 exactly (the config's experts_f16,
    # which the loader sets from the scales it read: `checkpoint.mark_experts_f16`); False: not known, the kernels
    # keep their float32 forms
    f16: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:  # the logical [E, O, In]
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])


def _stacks(tree) -> list:
    return [m for m in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, MXFP4)) if isinstance(m, MXFP4)]


def f16_exact(tree) -> bool:
    """Whether `tree` holds MXFP4 stacks and every scale byte of them lies in F16_SCALES (concrete arrays, host or
    device: one min and max each; traced ones are not known: False)."""
    stacks = _stacks(tree)
    if not stacks or any(isinstance(m.scale, jax.core.Tracer) for m in stacks):
        return False
    for m in stacks:
        lo, hi = jax.device_get((jnp.min(m.scale), jnp.max(m.scale))) if m.scale.size else F16_SCALES
        if not F16_SCALES[0] <= int(lo) <= int(hi) <= F16_SCALES[1]:
            return False
    return True


def with_f16(tree, f16: bool):
    """`tree` with every MXFP4 stack's static `f16` set to `f16` (the arrays unchanged)."""
    return jax.tree.map(lambda m: dataclasses.replace(m, f16=f16) if isinstance(m, MXFP4) else m, tree,
                        is_leaf=lambda x: isinstance(x, MXFP4))


def glu(a: jax.Array, b: jax.Array, act: str, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    """Gated activation in fp32: SiLU-GLU `silu(a)*b`, or SiTU-GLU (docs/SPEC.md §3.5):
    `β1·tanh(a/β1)·sigmoid(a) · β2·tanh(b/β2)`."""
    a, b = a.astype(F32), b.astype(F32)
    if act == "silu":
        return jax.nn.silu(a) * b
    if act == "situ":
        return beta * jnp.tanh(a / beta) * jax.nn.sigmoid(a) * (linear_beta * jnp.tanh(b / linear_beta))
    raise ValueError(f"hidden_act: unknown activation {act!r}")


def act(cfg: KimiK3Config, a: jax.Array, b: jax.Array) -> jax.Array:
    """The experts' GLU activation as the config names it (SiTU-GLU for K3, SiLU-GLU for Kimi-Linear)."""
    return glu(a, b, cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)


def e8m0_scales(scale_u8: jax.Array) -> jax.Array:
    """E8M0 bytes -> float32 2**(s - 127), exactly: the exponent field written directly (s >= 1), and
    2**-127 (a subnormal) for s = 0.  Scale 255 (NaN) is refused at load and never generated."""
    s = scale_u8.astype(jnp.int32)
    return jnp.where(s == 0, jnp.float32(2.0 ** -127), lax.bitcast_convert_type(s << 23, F32))


def dequantize(w: MXFP4) -> jax.Array:
    """float32 [..., O, In] from packed [..., O, In/2] and scale [..., O, In/32]: every value exact
    (3 significant bits times a power of two), equal to jaxk3.mxfp4.dequantize."""
    table = jnp.asarray(_E2M1_VALUES)
    codes = jnp.stack([w.packed & 0x0F, w.packed >> 4], axis=-1)  # [..., O, In/2, 2]: column 2j, 2j+1
    vals = table[codes.astype(jnp.int32)].reshape(*w.scale.shape, G32)
    return (vals * e8m0_scales(w.scale)[..., None]).reshape(*w.packed.shape[:-1], -1)


_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def expert_rows(w: jax.Array | MXFP4, ids: jax.Array) -> jax.Array:
    """The selected experts' matrices in float32, [*ids.shape, O, In] (dense: the stored values;
    MXFP4: dequantised from the selected experts' bytes only)."""
    if isinstance(w, MXFP4):
        return dequantize(MXFP4(jnp.take(w.packed, ids, axis=0), jnp.take(w.scale, ids, axis=0)))
    return jnp.take(w, ids, axis=0).astype(F32)


def compute_dtype(w, z: jax.Array):
    """The experts' input dtype: the dense experts' dtype, or the activations' for MXFP4."""
    return z.dtype if isinstance(w.experts_w2, MXFP4) else w.experts_w2.dtype


def experts_partial(cfg: KimiK3Config, w, z_BL: jax.Array, w_Bk: jax.Array, ids_Bk: jax.Array,
                    shared: SharedMLP | None = None) -> jax.Array:
    """Σ_k w_k · W2_k act(W1_k z, W3_k z) over the local intermediate shard: fp32 [B, L] partial
    (`w`: the block's weights, jaxk3.layers.moe.MoEWeights; only the experts are read: w1 and w3, or
    their serving-layout join experts_w13, and w2), plus `shared_partial` of z where `shared` is given.

    Each GEMV is written as gather · multiply · sum so that XLA fuses the expert gather into the
    reduction and reads each selected expert's weights once.  As an einsum over `jnp.take(...)`
    the gather is materialised first (a [B, k, I, L] copy written and read again: measured on
    2x H200 as 4.2 GB of extra traffic per K3 decode step at B=1, docs/PERF.md)."""
    dt = compute_dtype(w, z_BL)
    z = z_BL.astype(dt).astype(F32)  # the experts see the compute dtype, as in vLLM

    def gemv(w_EOI: jax.Array | MXFP4, x_BkI: jax.Array) -> jax.Array:  # [B, k, O] = W[ids] @ x, fp32
        return jnp.sum(expert_rows(w_EOI, ids_Bk) * x_BkI[:, :, None, :], axis=-1)

    zk = jnp.broadcast_to(z[:, None, :], (*ids_Bk.shape, z.shape[-1]))
    if getattr(w, "experts_w13", None) is not None:  # the serving layout: w1 | w3 in one read of each expert
        h_Bk2I = gemv(w.experts_w13, zk)
        h1_BkI, h3_BkI = h_Bk2I[..., :h_Bk2I.shape[-1] // 2], h_Bk2I[..., h_Bk2I.shape[-1] // 2:]
    else:
        h1_BkI = gemv(w.experts_w1, zk)
        h3_BkI = gemv(w.experts_w3, zk)
    a_BkI = act(cfg, h1_BkI, h3_BkI).astype(dt).astype(F32)
    y_BkL = gemv(w.experts_w2, a_BkI)
    out = jnp.einsum("bkl,bk->bl", y_BkL, w_Bk)
    return out if shared is None else out + shared_partial(cfg, shared, z_BL)


def shared_partial(cfg: KimiK3Config, s: SharedMLP, x_BD: jax.Array) -> jax.Array:
    """The shared experts' row-parallel partial, fp32 [B, Out], as jaxk3.layers.moe.mlp_partial computes it
    through XLA's dots (the same operations, so the same bits)."""
    h = jnp.einsum("bk,nk->bn", x_BD.astype(s.gate_up.dtype), s.gate_up, preferred_element_type=F32)
    I = s.down.shape[1]
    a = act(cfg, h[:, :I], h[:, I:]).astype(x_BD.dtype)
    return jnp.einsum("bk,nk->bn", a.astype(s.down.dtype), s.down, preferred_element_type=F32)



# ---------------------------------------------------------------- the Pallas kernels


def plan_slots(num_experts: int, B: int, k: int) -> int:
    """`plan`'s slot count U for B tokens of k choices each: min(E, B·k) (k at one token)."""
    return min(num_experts, B * k)


def plan(ids_Bk: jax.Array, w_Bk: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(uniq_U int32: the distinct selected experts, then -1 padding; coef_UB fp32: token b's routing
    weight for expert uniq[u], 0 where b did not choose it), U = min(E, B·k).  At B = 1 the k choices
    are distinct (top-k): they are the plan as they come, no sort."""
    B, k = ids_Bk.shape
    if B == 1:
        return ids_Bk[0].astype(jnp.int32), w_Bk.T.astype(F32)
    U = plan_slots(num_experts, B, k)
    uniq = jnp.unique(ids_Bk.reshape(-1), size=U, fill_value=-1).astype(jnp.int32)
    hit = ids_Bk[None, :, :] == uniq[:, None, None]  # [U, B, k]
    coef = jnp.sum(jnp.where(hit, w_Bk[None].astype(F32), 0.0), axis=-1)
    return uniq, coef


def _e2m1(code: jax.Array) -> jax.Array:
    """int32 E2M1 codes (0..15) -> float32 values, by arithmetic (no table): bit 3 sign, bits 1-2
    exponent, bit 0 mantissa; exponent 0 is the subnormal 0 / 0.5."""
    e, m = (code >> 1) & 3, (code & 1).astype(F32)
    p2 = jnp.where(e == 1, 1.0, jnp.where(e == 2, 2.0, 4.0)).astype(F32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * p2)
    return jnp.where(code >= 8, -mag, mag)


def _e2m1_scaled_bits(code: jax.Array, s: jax.Array) -> jax.Array:
    """int32 E2M1 codes (0..15) times 2**(s - 127) for int32 E8M0 bytes s (broadcast per scale group), as
    float32 built from its bits: the value (1 + m/2)·2^(e−1) (e = 1..3) or m/2 (e = 0) times 2^(c − 127) is
    the float32 of exponent field e + c − 1 (c − 1 for 0.5) and mantissa m·2^22, normal for c in [2, 252].
    So with c = s clamped there, one product by the group's power of two 2^(s − c) (exactly 1.0 for every
    scale real checkpoints hold; 2^-2, 2^-1, 2, 4 and +inf at s = 0, 1, 253, 254, 255) gives the select
    decode's value bit for bit (both are one rounding of the same exact product): no select chain per
    weight, one multiply as the select decode has."""
    e, m = (code >> 1) & 3, code & 1
    c = jnp.clip(s, 2, 252)
    field = jnp.where(e == 0, c - 1, e + c - 1)
    bits = jnp.where((e == 0) & (m == 0), 0, (field << 23) | jnp.where(e == 0, 0, m << 22)) | ((code >> 3) << 31)
    # per group: 2^(s − c) as the reference's own scale times 2^(127 − c), so that a platform that flushes
    # the subnormal 2^-127 (s = 0) to zero flushes it here too
    rest = e8m0_scales(s) * lax.bitcast_convert_type((254 - c) << 23, F32)
    return lax.bitcast_convert_type(bits, F32) * rest


def _e2m1_f16(code: jax.Array) -> jax.Array:
    """int32 E2M1 codes (0..15) -> float32 value × 2^-14, exactly, through float16's bits: the code's magnitude
    bits are float16's lowest exponent bits and top mantissa bit ((e, m) -> exponent field e, mantissa m·2^9),
    so e = 0 lands on float16's subnormals (0 and 0.5·2^-14) and e >= 1 on (1 + m/2)·2^(e−15); the sign moves
    to bit 15.  Five integer operations and one conversion per weight, no select; times 2^14 then the scale
    (two exact-or-one-rounding products) it is the select decode's value bit for bit.  The sign bit makes
    the int32 exceed int16's range (up to 0x8E00): the cast to int16 wraps, keeping the 16 bits (XLA and
    Triton both truncate)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16).astype(F32)


# The "asm" decode: `_e2m1_f16`'s values from PTX, four bytes (eight codes) per instance.  Triton packs the four
# uint8 operands into one 32-bit register w (byte i in bits 8i..8i+7).  A code c sits in float16's bits as
# ((c & 7) << 9) | ((c & 8) << 12); bytes 0 and 2 (and 1 and 3) are 16 bits apart, as the halves of a float16 pair
# are, so each pair of codes is two shifts and masks of w, with no byte moved alone:
#   low nibbles of bytes 0, 2: (w << 9) & 0x0E000E00 | (w << 12) & 0x80008000
#   low nibbles of bytes 1, 3: (w << 1) & 0x0E000E00 | (w << 4)  & 0x80008000
#   high nibbles of bytes 0, 2: (w << 5) & 0x0E000E00 | (w << 8) & 0x80008000
#   high nibbles of bytes 1, 3: (w >> 3) & 0x0E000E00 | w & 0x80008000
# then each half widened to float32 (exact).  Outputs $0-$3: bytes 0-3's values.  The low and high nibbles are two
# instances (jax's Pallas lowers one result per inline asm).
_ASM_PAIR = ("{pre} p, $4, {a}; and.b32 p, p, 0x0E000E00; {qop} and.b32 q, q, 0x80008000; or.b32 r, p, q; "
             "mov.b32 {{h0, h1}}, r; cvt.f32.f16 ${o0}, h0; cvt.f32.f16 ${o1}, h1;")
_ASM_HEAD = "{ .reg .b32 p, q, r; .reg .b16 h0, h1; "
_ASM_LO = _ASM_HEAD + " ".join([_ASM_PAIR.format(pre="shl.b32", a=9, qop="shl.b32 q, $4, 12;", o0=0, o1=2),
                                _ASM_PAIR.format(pre="shl.b32", a=1, qop="shl.b32 q, $4, 4;", o0=1, o1=3)]) + " }"
_ASM_HI = _ASM_HEAD + " ".join([_ASM_PAIR.format(pre="shl.b32", a=5, qop="shl.b32 q, $4, 8;", o0=0, o1=2),
                                _ASM_PAIR.format(pre="shr.b32", a=3, qop="mov.b32 q, $4;", o0=1, o1=3)]) + " }"


def _e2m1_f16_asm(codes_u8: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 bytes [..] -> (low nibbles', high nibbles') float32 values × 2^-14 [..] each: `_e2m1_f16`'s values bit for
    bit, decoded by `_ASM_LO` and `_ASM_HI` in ~2.75 instructions a code (Pallas Triton only: the compiled kernel's
    "asm" decode)."""
    from jax.experimental.pallas import triton as plt

    out = [jax.ShapeDtypeStruct(codes_u8.shape, F32)]
    return tuple(plt.elementwise_inline_asm(asm, args=[codes_u8], constraints="=f,=f,=f,=f,r", pack=4,
                                            result_shape_dtypes=out)[0] for asm in (_ASM_LO, _ASM_HI))


# The "f16" tensor-core form (`Config.f16`): E8M0 bytes s for which every code times 2^(s − 127) is a float16 exactly.
# The decode's bits are code · 2^-14 (a subnormal for 0.5); times the float16 2^(s − 113) (normal for s in [99, 128])
# the product code · 2^(s − 127) is exact down to float16's smallest subnormal 2^-24 (0.5 · 2^(s − 127): s >= 104)
# and finite up to 6 · 2^(s − 127) <= 65504.  Real checkpoints' experts (|w| < 12 per group, no group below 2^-21)
# lie inside; `f16_exact` checks the stacks at load (`checkpoint.mark_experts_f16`), and a stack outside keeps the
# float32 forms.
F16_SCALES = (104, 128)
# Eight codes of a 32-bit word w as four float16 pairs in the pack=4 output order (result register j holds elements
# 2j, 2j + 1 in its low and high halves): prmt puts bytes (0, 2, 1, 3) at positions (0, 1, 2, 3), so positions 0, 2
# are bytes 0, 1 and positions 1, 3 bytes 2, 3; then `_ASM_LO`/`_ASM_HI`'s shifts and masks, and one mul.rn.f16x2
# by each pair's own scales ($3: elements 0, 1's float16 2^(s − 113), $4: elements 2, 3's).  Which elements Triton
# packs together is its layout's choice: four bytes of one row (mma.sync's B operand) or two rows' pairs (wgmma's A
# operand with `Config.swap`, rows r and r + 8), so no two pairs may share a scale register.
_ASM16_PAIR = ("{pre} p, w, {a}; and.b32 p, p, 0x0E000E00; {qop} and.b32 q, q, 0x80008000; or.b32 p, p, q; "
               "mul.rn.f16x2 ${o}, p, ${s};")
_ASM16_HEAD = "{ .reg .b32 w, p, q; prmt.b32 w, $2, 0, 0x3120; "
_ASM16_LO = _ASM16_HEAD + " ".join([_ASM16_PAIR.format(pre="shl.b32", a=9, qop="shl.b32 q, w, 12;", o=0, s=3),
                                    _ASM16_PAIR.format(pre="shl.b32", a=1, qop="shl.b32 q, w, 4;", o=1, s=4)]) + " }"
_ASM16_HI = _ASM16_HEAD + " ".join([_ASM16_PAIR.format(pre="shl.b32", a=5, qop="shl.b32 q, w, 8;", o=0, s=3),
                                    _ASM16_PAIR.format(pre="shr.b32", a=3, qop="mov.b32 q, w;", o=1, s=4)]) + " }"


def _f16_scale(s_u8: jax.Array) -> jax.Array:
    """E8M0 bytes in F16_SCALES -> float16 2^(s − 113), from its bits (exponent field s − 98)."""
    bits = (s_u8.astype(jnp.int32) - 98) << 10
    return lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16)


def _e2m1_f16_scaled(sp: "_Spec", codes_u8: jax.Array, s16: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 bytes [.., 16] and their group's float16 2^(s − 113) [.., 16] -> (low, high) nibbles' float16 values
    code · 2^(s − 127), exact for s in F16_SCALES: by `_ASM16_LO`/`_ASM16_HI` ("asm") or by `_e2m1_f16`'s float32 raw
    values times the float16 scale, rounded once to float16 (interpret mode and the other decodes: the same values)."""
    if sp.decode == "asm":
        from jax.experimental.pallas import triton as plt

        out = [jax.ShapeDtypeStruct(codes_u8.shape, jnp.float16)]
        s16 = jnp.broadcast_to(s16, codes_u8.shape)
        return tuple(plt.elementwise_inline_asm(asm, args=[codes_u8, s16], constraints="=r,=r,r,r,r", pack=4,
                                                result_shape_dtypes=out)[0] for asm in (_ASM16_LO, _ASM16_HI))
    codes = codes_u8.astype(jnp.int32)
    f = jnp.broadcast_to(s16, codes_u8.shape).astype(F32)
    return tuple((_e2m1_f16(c) * f).astype(jnp.float16) for c in (codes & 15, codes >> 4))


def _raw(sp: "_Spec", codes_u8: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """uint8 bytes -> (low, high) nibbles' float32 raw values and the factor that makes them E2M1's: "f16" and "asm"
    (the same bits from PTX) give the values × 2^-14 and 2^14, "select" the values themselves and None."""
    if sp.decode == "asm":
        return (*_e2m1_f16_asm(codes_u8), F32(2.0 ** 14))
    codes = codes_u8.astype(jnp.int32)
    if sp.decode == "f16":
        return _e2m1_f16(codes & 15), _e2m1_f16(codes >> 4), F32(2.0 ** 14)
    return _e2m1(codes & 15), _e2m1(codes >> 4), None


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What the kernels' bodies need to know, static."""
    Bp: int  # rows of the padded input: 1 (element-wise), 16 (dense, dot) or B's power of two (MXFP4)
    packed: bool
    bn: int
    bk: int
    decode: str
    group: bool = False  # Config.scale == "group"
    mx_dot: bool = False  # Config.mx_dot where it applies (MXFP4, B > 1)
    f16: bool = False  # Config.f16 (MXFP4, any B; takes precedence over mx_dot)
    swap: bool = False  # Config.swap (f16, or set for bf16): `_mma`'s result is [bn, Bp], transposed after the loop

    @property
    def dot(self) -> bool:
        return (self.Bp == 16 and (not self.packed or self.mx_dot)) or ((self.swap or self.f16) and self.Bp > 1)


def _pl():
    from jax.experimental import pallas as pl

    return pl


def _tile(sp: _Spec, w, e, rows, i):
    """Weights at `rows` (of expert e; e None: a 2-D weight), input tile i: dense [bn, bk] in their dtype,
    MXFP4 the (even, odd) columns' float32 values [bn, g, 16], g = bk / 32 scale groups."""
    pl = _pl()
    lead = () if e is None else (e,)
    if not sp.packed:
        return w[0][(*lead, rows, pl.ds(pl.multiple_of(i * sp.bk, sp.bk), sp.bk))]
    g = sp.bk // G32
    grp = pl.ds(pl.multiple_of(i * g, g), g)
    if sp.decode == "bits":
        codes = w[0][(*lead, rows, grp, slice(None))].astype(jnp.int32)  # [bn, g, 16] bytes
        s = w[1][(*lead, rows, grp)].astype(jnp.int32)[:, :, None]
        return _e2m1_scaled_bits(codes & 15, s), _e2m1_scaled_bits(codes >> 4, s)
    lo, hi, pre = _raw(sp, w[0][(*lead, rows, grp, slice(None))])  # [bn, g, 16] each
    s = e8m0_scales(w[1][(*lead, rows, grp)])  # [bn, g]
    if sp.group:  # the raw values and the group factor [bn, g], applied after the sums
        return lo, hi, s, pre
    s = s[:, :, None]
    if pre is not None:
        lo, hi = lo * pre, hi * pre
    return lo * s, hi * s


def _xs(sp: _Spec, x, lead: tuple, i):
    """Input tile i at the leading index `lead`: dense [.., bk] in the input dtype; MXFP4 the (even, odd)
    columns [.., g, 16] as float32 (of the compute dtype, as the reference casts)."""
    pl = _pl()
    if not sp.packed:
        return x[0][(*lead, pl.ds(pl.multiple_of(i * sp.bk, sp.bk), sp.bk))]
    g = sp.bk // G32
    grp = pl.ds(pl.multiple_of(i * g, g), g)
    return tuple(r[(*lead, grp, slice(None))].astype(F32) for r in x)  # (a no-op with Config.x_f32)


def _grouped(lo, hi, s, pre, xe, xo):
    """One token's sums of a tile in the "group" form: Σ over each group's 32 products of the raw values and x,
    then times 2^14 (f16's raw values) and the group's scale: [bn, g] (the factors are powers of two: exact)."""
    p = jnp.sum(lo * xe[None] + hi * xo[None], axis=2)
    return (p if pre is None else p * pre) * s


def _mx_dot_rows(sp: _Spec, w, e, rows, x, lead: tuple, steps: int, start=0):
    """MXFP4 on the tensor cores (`Config.mx_dot`): Σ over the input tiles [start, start + steps) of W[e, rows, :] ·
    x[lead] for 16 (padded) token rows, fp32 [16, bn].  Each scale group j: the codes' raw values (f16's times 2^-14,
    or the select decode's) in bf16, exactly (E2M1 has one mantissa bit), against the tokens' even and odd columns
    [16, 16] in two dots (bf16 products are exact in fp32), the sum times 2^14 (f16) and the group's scale, powers of
    two: the reference's exact products, summed per group and then across groups."""
    pl = _pl()
    wl = () if e is None else (e,)
    g = sp.bk // G32

    def body(i, acc):
        for j in range(g):
            grp = (start + i) * g + j
            lo, hi, pre = _raw(sp, w[0][(*wl, rows, grp, slice(None))])  # [bn, 16] each
            lo, hi = lo.astype(jnp.bfloat16), hi.astype(jnp.bfloat16)
            xe, xo = (r[(*lead, slice(None), grp, slice(None))] for r in x)  # [16, 16] each
            f = e8m0_scales(w[1][(*wl, rows, grp)]) * (F32(1.0) if pre is None else pre)  # [bn]
            acc = acc + (dot_nt(xe, lo) + dot_nt(xo, hi)) * f[None, :]
        return acc
    return lax.fori_loop(0, steps, body, jnp.zeros((16, sp.bn), F32))


def _mma(sp: _Spec, xt: jax.Array, wt: jax.Array) -> jax.Array:
    """One tile's products on the tensor cores, tokens xt [Bp, K] and weights wt [bn, K]: [bn, Bp] with `swap` (the
    weights the MMA's M side), else [Bp, bn]; `_mma_loop` accumulates them."""
    return dot_nt(wt, xt) if sp.swap else dot_nt(xt, wt)


def _mma_loop(sp: _Spec, steps: int, body) -> jax.Array:
    """fori_loop(0, steps, body) from a zero accumulator in `_mma`'s orientation, returned as fp32 [Bp, bn]."""
    if sp.swap:
        return lax.fori_loop(0, steps, body, jnp.zeros((sp.bn, sp.Bp), F32)).T
    return lax.fori_loop(0, steps, body, jnp.zeros((sp.Bp, sp.bn), F32))


def _f16_dot_rows(sp: _Spec, w, e, rows, x, lead: tuple, steps: int, start=0):
    """MXFP4 on float16 tensor cores (`Config.f16`): Σ over the input tiles [start, start + steps) of W[e, rows, :] ·
    x[lead] for Bp (padded) token rows given as float16 (even, odd) columns [Bp, In/32, 16], fp32 [Bp, bn].  Each
    scale group's codes become float16 values code · 2^(s − 127) exactly (`_e2m1_f16_scaled`), against the tokens' even
    and odd columns in two `_mma`s of bk/2 columns per tile: float16 products are exact in fp32."""
    pl = _pl()
    wl = () if e is None else (e,)
    g = sp.bk // G32

    def body(i, acc):
        grp = pl.ds(pl.multiple_of((start + i) * g, g), g)
        s16 = _f16_scale(w[1][(*wl, rows, grp)])  # [bn, g]
        lo, hi = _e2m1_f16_scaled(sp, w[0][(*wl, rows, grp, slice(None))], s16[:, :, None])  # [bn, g, 16] each
        xe, xo = (r[(*lead, slice(None), grp, slice(None))].reshape(sp.Bp, g * 16) for r in x)  # [Bp, bk / 2] each
        return acc + _mma(sp, xe, lo.reshape(sp.bn, g * 16)) + _mma(sp, xo, hi.reshape(sp.bn, g * 16))
    return _mma_loop(sp, steps, body)


def _gemv_rows(sp: _Spec, w, e, rows, x, lead: tuple, steps: int, start=0):
    """Σ over the input tiles [start, start + steps) of W[e, rows, :] · x[lead]: fp32 [bn] (B = 1),
    [16, bn] (dense, dot; MXFP4 with `mx_dot`) or a tuple of Bp [bn] (MXFP4, B > 1)."""
    if sp.dot and sp.packed and sp.f16:
        return _f16_dot_rows(sp, w, e, rows, x, lead, steps, start)
    if sp.dot and sp.packed:
        return _mx_dot_rows(sp, w, e, rows, x, lead, steps, start)
    if sp.dot:
        def body(i, acc):
            return acc + _mma(sp, _xs(sp, x, (*lead, slice(None)), start + i), _tile(sp, w, e, rows, start + i))
        return _mma_loop(sp, steps, body)
    if sp.Bp == 1 and not sp.packed:
        def body(i, acc):
            xt = _xs(sp, x, (*lead, 0), start + i).astype(F32)
            return acc + _tile(sp, w, e, rows, start + i).astype(F32) * xt[None, :]
        return jnp.sum(lax.fori_loop(0, steps, body, jnp.zeros((sp.bn, sp.bk), F32)), axis=1)
    if sp.Bp == 1 and sp.group:  # MXFP4, one token, the scale per group: [bn, g] accumulators
        def body(i, acc):
            return acc + _grouped(*_tile(sp, w, e, rows, start + i), *_xs(sp, x, (*lead, 0), start + i))
        return jnp.sum(lax.fori_loop(0, steps, body, jnp.zeros((sp.bn, sp.bk // G32), F32)), axis=1)
    if sp.Bp == 1:  # MXFP4, one token: element-wise accumulators for the even and odd columns
        def body(i, acc):
            lo, hi = _tile(sp, w, e, rows, start + i)
            xe, xo = _xs(sp, x, (*lead, 0), start + i)
            return acc[0] + lo * xe[None], acc[1] + hi * xo[None]
        zero = jnp.zeros((sp.bn, sp.bk // G32, 16), F32)
        lo, hi = lax.fori_loop(0, steps, body, (zero, zero))
        return jnp.sum(jnp.sum(lo + hi, axis=2), axis=1)

    def body(i, acc):  # MXFP4, several tokens: one decode per tile, each token's products reduced per tile
        t = _tile(sp, w, e, rows, start + i)
        out = []
        for b in range(sp.Bp):
            xe, xo = _xs(sp, x, (*lead, b), start + i)
            if sp.group:
                out.append(acc[b] + jnp.sum(_grouped(*t, xe, xo), axis=1))
            else:
                lo, hi = t
                out.append(acc[b] + jnp.sum(jnp.sum(lo * xe[None] + hi * xo[None], axis=2), axis=1))
        return tuple(out)
    return lax.fori_loop(0, steps, body, tuple(jnp.zeros((sp.bn,), F32) for _ in range(sp.Bp)))


def _store(ref, lead: tuple, rows, y) -> None:
    """Write rows of a result shaped as `_gemv_rows` returns it: [bn] (token 0), [Bp, bn] or a tuple."""
    if isinstance(y, tuple):
        for b, yb in enumerate(y):
            ref[(*lead, b, rows)] = yb.astype(ref.dtype)
    elif y.ndim == 1:
        ref[(*lead, 0, rows)] = y.astype(ref.dtype)
    else:
        ref[(*lead, slice(None), rows)] = y.astype(ref.dtype)


@dataclasses.dataclass(frozen=True)
class _Route:
    """The router's selection done inside the kernels (`experts_routed`): one token's logits over E experts padded
    to Ep (a power of two), k chosen, in the router's order, the weights renormalised (`renorm`) and scaled."""
    E: int
    Ep: int
    k: int
    renorm: bool
    scale: float
    chunk: int = 32  # columns of the [Ep, chunk] comparison tiles the ranks are summed over


def _route_ranks(logits_ref, bias_ref, rt: _Route):
    """(s, rank, idx) [Ep] each for the token: s = sigmoid(logits) (0 on the padding), and rank_i = the number of
    experts before expert i in lax.top_k's order of the selection score s + bias (larger first, the lower index
    first among equal ones; the padding after every expert), so that the token's slot u (< k) is the expert whose
    rank is u.  One comparison tile and one sum per `chunk` columns: no loop of k dependent reductions as in the
    router kernel."""
    pl = _pl()

    def scores(start: int, n: int):
        j = start + lax.broadcasted_iota(jnp.int32, (n,), 0)
        inside = j < rt.E
        s = jnp.where(inside, jax.nn.sigmoid(logits_ref[0, pl.ds(start, n)]), 0.0)
        return s, jnp.where(inside, s + bias_ref[pl.ds(start, n)], -jnp.inf), j

    s, sel, idx = scores(0, rt.Ep)
    rank = jnp.zeros((rt.Ep,), jnp.int32)
    for c in range(0, rt.Ep, rt.chunk):
        _, sj, j = scores(c, rt.chunk)
        before = (sj[None, :] > sel[:, None]) | ((sj[None, :] == sel[:, None]) & (j[None, :] < idx[:, None]))
        rank = rank + jnp.sum(before.astype(jnp.int32), axis=1)
    return s, rank, idx


def _weights(s, rank, rt: _Route):
    """Each expert's routing weight for one token from `_route_ranks`, as `select_experts` computes it: s_e / (Σ
    over the k chosen s + 1e-20) · scale (or s_e · scale without renormalising) for the chosen, 0 elsewhere."""
    mine = rank < rt.k
    if rt.renorm:
        s = s / (jnp.sum(jnp.where(mine, s, 0.0)) + F32(1e-20))
    return jnp.where(mine, s * F32(rt.scale), 0.0)


def _gate_up_kernel(*refs, sp: _Spec, nsel: int, route: _Route | None, nx: int, nw: int, joined: bool, shared: bool,
                    I: int, steps: int, act):
    """Program (u, n): slot u's activations, rows [n·bn, (n+1)·bn) of I, for every token.  Slot U (when
    `shared`) is the shared experts'; a padded slot (expert -1) writes zeros.  The slot's expert is
    uniq[u] (the first ref), or with `route` (one token, U = k, no padded slot) the u-th choice of the router's
    logits and bias (the first two); then the programs (u, 0) also write the slot's expert and its weight
    (`read` [U], `coef` [1, U]: kernel 2's inputs)."""
    pl = _pl()
    sel, refs = refs[:nsel], refs[nsel:]
    x, refs = refs[:nx], refs[nx:]
    if sp.f16:  # the tokens' 2^-k, their float16 copies' power of two undone [16, 1]
        xinv, refs = refs[0], refs[1:]
    w1, refs = refs[:nw], refs[nw:]
    w3, refs = (w1, refs) if joined else (refs[:nw], refs[nw:])
    if route is not None:
        refs, (read_ref, coef_ref) = refs[:-2], refs[-2:]
    a_ref = refs[-1]
    u, n = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(pl.multiple_of(n * sp.bn, sp.bn), sp.bn)
    up = pl.ds(pl.multiple_of(I + n * sp.bn, sp.bn), sp.bn)  # the up rows of a [gate | up] join
    if route is None:
        U = sel[0].shape[0]
        e = sel[0][jnp.minimum(u, U - 1)]
    else:  # one token: slot u is the expert of rank u
        U = route.k
        s, rank, idx = _route_ranks(*sel, route)
        hit = rank == jnp.minimum(u, U - 1)
        e = jnp.minimum(jnp.sum(jnp.where(hit, idx, 0)), route.E - 1)  # NaN logits can share a rank: stay in bounds

        @pl.when((u < U) & (n == 0))
        def _():
            read_ref[u] = e
            coef_ref[0, u] = jnp.sum(jnp.where(hit, _weights(s, rank, route), 0.0))

    def gate_up(w1, w3, e, rows3):
        h1 = _gemv_rows(sp, w1, e, rows, x, (), steps)
        h3 = _gemv_rows(sp, w3, e, rows3, x, (), steps)
        if sp.f16:
            h1, h3 = h1 * xinv[...], h3 * xinv[...]
        y = tuple(act(a, b) for a, b in zip(h1, h3)) if isinstance(h1, tuple) else act(h1, h3)
        _store(a_ref, (u,), rows, y)

    @pl.when((u < U) & (e >= 0))
    def _():
        gate_up(w1, w3, e, up if joined else rows)

    @pl.when((u < U) & (e < 0))
    def _():
        a_ref[u, :, rows] = jnp.zeros((sp.Bp, sp.bn), a_ref.dtype)

    if shared:
        @pl.when(u == U)
        def _():
            s13 = refs[:1]
            gate_up(s13, s13, None, up)


def _down_kernel(read_ref, coef_ref, *refs, sp: _Spec, na: int, nw: int, shared: bool, steps: int, parts: int = 1,
                 fold: bool = False):
    """Program (n, s): output rows [n·bn, (n+1)·bn), the s-th part of I: Σ over the slots u of
    coef[:, u] · W2[read[u]] a[u] (+ the shared experts' down projection of slot U), one partial sum
    (coef [Bp, U]: at B = 1 the routing weights as the router gives them, or as kernel 1 wrote them).
    `fold` (one token, one part): the residual stream's rows h (the last input, [1, L]) added in float32 and the sum
    rounded to h's dtype, the new stream, as `add_residual` does after the kernel otherwise."""
    pl = _pl()
    a, refs = refs[:na], refs[na:]
    if sp.f16:  # each slot's tokens' 2^-k [P, 16, 1]
        ainv, refs = refs[0], refs[1:]
    if fold:
        h_ref, refs = refs[-2], refs[:-2] + refs[-1:]
    w2, o_ref = refs[:nw], refs[-1]
    n, s, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(pl.multiple_of(n * sp.bn, sp.bn), sp.bn)
    start = s * steps
    U = read_ref.shape[0]
    per = -(-U // parts)  # the slots [part·per, min((part + 1)·per, U)) of `parts` (slot_splits)

    def scaled(y, u):  # coef[:, u] (token b's routing weight of slot u) times the slot's product, per token
        if isinstance(y, tuple):
            return tuple(coef_ref[b, u] * yb for b, yb in enumerate(y))
        if y.ndim == 1:
            return coef_ref[0, u] * y
        return coef_ref[:, u][:, None] * y

    def add(acc, y):
        return tuple(p + q for p, q in zip(acc, y)) if isinstance(acc, tuple) else acc + y

    def product(u):  # slot u's coef-weighted down projection of these rows
        y = _gemv_rows(sp, w2, read_ref[u], rows, a, (u,), steps, start)
        return scaled(y * ainv[u] if sp.f16 else y, u)

    def body(u, acc):
        return add(acc, product(u))

    if sp.dot:
        zero = jnp.zeros((sp.Bp, sp.bn), F32)
    elif sp.Bp == 1:
        zero = jnp.zeros((sp.bn,), F32)
    else:
        zero = tuple(jnp.zeros((sp.bn,), F32) for _ in range(sp.Bp))

    def body_part(i, acc):  # a static trip count: the last part's slots past U re-read slot U - 1, times 0
        u = part * per + i
        y = product(jnp.minimum(u, U - 1))
        keep = lambda t: jnp.where(u < U, t, 0.0)  # noqa: E731
        return add(acc, tuple(keep(t) for t in y) if isinstance(y, tuple) else keep(y))

    y = lax.fori_loop(0, U, body, zero) if parts == 1 else lax.fori_loop(0, per, body_part, zero)
    if shared:  # (with one part: `fits`)
        y = add(y, _gemv_rows(sp, refs[nw:nw + 1], None, rows, a, (U,), steps, start))
    if fold:  # (y [bn]: one token, element-wise; `_fold_config`)
        y = h_ref[0, rows].astype(F32) + y
    _store(o_ref, (s * parts + part,), rows, y)


def _weight_views(w) -> tuple[list[jax.Array], bool]:
    """A weight stack as the kernels index it: MXFP4 -> ([packed [E, O, In/32, 16], scale [E, O, In/32]],
    True), dense -> ([w], False).  Reshapes of contiguous trailing dims: no copies."""
    if isinstance(w, MXFP4):
        E, O, half = w.packed.shape
        return [w.packed.reshape(E, O, half // 16, 16), w.scale], True
    return [w], False


def _x_views(x: jax.Array, packed: bool, f32: bool = False) -> list[jax.Array]:
    """Inputs [..., In] as [..., In/32, 16] even and odd columns (MXFP4; `f32`: widened to float32) or as they are."""
    if not packed:
        return [x]
    v = x.reshape(*x.shape[:-1], x.shape[-1] // G32, G32)
    if f32:
        v = v.astype(F32)
    return [v[..., 0::2], v[..., 1::2]]


def f16_scaled(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows [..., R, In] (bf16 values, any float dtype) -> float16 [..., R, In] times 2^k per row, and 2^-k [..., R, 1]
    float32: k puts the row's largest magnitude in [2^14, 2^15) (k = 0 for a row of zeros; |k| <= 126), so nothing
    overflows and every value above 2^-17 of the row's maximum is exact (bf16's 8 significant bits; below, float16's
    subnormals round it by at most 2^-39 of the maximum)."""
    x = x.astype(F32)
    m = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    _, ex = jnp.frexp(m)  # m in [2^(ex-1), 2^ex)
    k = jnp.where(m > 0, jnp.clip(15 - ex, -126, 126), 0)
    return jnp.ldexp(x, k).astype(jnp.float16), jnp.ldexp(jnp.ones_like(m), -k)


def _f16_views(x: jax.Array) -> tuple[list[jax.Array], jax.Array]:
    """`f16_scaled`'s float16 rows as their (even, odd) columns [..., R, In/32, 16], and 2^-k [..., R, 1]."""
    v, inv = f16_scaled(x)
    return _x_views(v, True), inv


def _cuda_problem(cf: Config, w, z_BL: jax.Array, shared, routed: bool = False, down: tuple | None = None
                  ) -> str | None:
    """Why kernel 1 (or with `down` = (U, parts[, streaming depth]), kernel 2) cannot be the CUDA kernel for this call
    (None: it can)."""
    B, (_, I, In, Out, _) = z_BL.shape[0], _dims(w)
    wide = _cuda_form(cf, B)[0] == "wide"
    if (B > (MAX_B if wide else 1) or not isinstance(w.experts_w2, MXFP4) or not _f16_marked(w)
            or z_BL.dtype != jnp.bfloat16):
        return (f"the CUDA kernels take one token (1 to {MAX_B} with Config.cuda_wide) of bf16 activations and MXFP4 "
                f"stacks marked f16, got B {B}, {z_BL.dtype}, "
                f"{'MXFP4' if isinstance(w.experts_w2, MXFP4) else 'dense'} experts"
                f"{'' if _f16_marked(w) else ' (not marked f16)'}")
    if shared is not None or routed:
        return "the CUDA kernels take neither the shared experts nor the router's logits"
    if cf.f16 and B == 1:  # (`f16` at one token: the float16 dot form over 8 padded rows, kept in Pallas)
        return "the CUDA kernels replace the one-token element-wise form, not Config.f16's dot over padded rows"
    Bp = _rows_padded(w, z_BL, cf) if wide and B > 1 else 1  # (the Pallas kernels' rows between them)
    if Bp > CU.MAX_TOKENS:
        return (f"the wide CUDA kernels write at most {CU.MAX_TOKENS} token rows, and this config pads the tokens to "
                f"{Bp} (Config.f16 with swap, the default at B > 1, pads them to 8)")
    if down:
        stream = len(down) > 2 and bool(down[2])
        return CU.down_problem(down[0], I, Out, down[1], wide, stream) or CU.unavailable(CU.DOWN_TARGET)
    return CU.shape_problem(I, In) or CU.unavailable(CU.TARGET)


def _cuda_wanted(cf: Config, down: bool = False) -> bool:
    if down:
        return CUDA_DOWN if cf.cuda_down is None else bool(cf.cuda_down)
    return CUDA_GATE_UP if cf.cuda is None else bool(cf.cuda)


def _cuda_form(cf: Config, B: int) -> tuple[str, bool]:
    """(input form, l2) of the CUDA kernels at B tokens: their inputs "wide" (Config.cuda_wide: 1 to 8 tokens' float16
    rows read through L1; None: CUDA_WIDE at B > 1), "raw" (Config.cuda_raw: bf16 as it is, the float16 copy made in
    shared memory) or "f16" (the float16 copy XLA made, in shared memory: the one-token default); and the weight
    loads' L2 hint (Config.cuda_l2).  None: the defaults."""
    wide = (CUDA_WIDE and B > 1) if cf.cuda_wide is None else bool(cf.cuda_wide)
    raw = CUDA_RAW if cf.cuda_raw is None else bool(cf.cuda_raw)
    return ("wide" if wide else "raw" if raw else "f16"), (CUDA_L2 if cf.cuda_l2 is None else bool(cf.cuda_l2))


def _cuda_stages(cf: Config, form: str, U: int) -> int:
    """Kernel 1's ring depth (0: the register form): Config.cuda_stages, else CUDA_STAGES in the one-token "f16" form
    and CUDA_STAGES_WIDE in the wide form where the streaming form takes the call (at most CU.MAX_STREAM_SLOTS slots),
    else 0 (the raw form).  An explicit depth it cannot take is `fits`'s refusal, not this."""
    if cf.cuda_stages is not None:
        return int(cf.cuda_stages)
    stages = {"f16": CUDA_STAGES, "wide": CUDA_STAGES_WIDE}.get(form, 0)
    return stages if CU.stream_problem(stages, U, False) is None else 0


def _cuda_down_stages(cf: Config, B: int, U: int) -> int:
    """Kernel 2's ring depth in CUDA (0: the register form): an explicit Config.cuda_stages, in the one-token form from
    XLA's float16 copies only (not the wide or raw forms); CUDA_STAGES is kernel 1's alone."""
    return int(cf.cuda_stages) if cf.cuda_stages is not None and _cuda_form(cf, B)[0] == "f16" else 0


def add_residual(y: jax.Array, residual: jax.Array | None) -> jax.Array:
    """The block's fp32 output, or with `residual` the new residual stream bf16(residual + y) (the decode step's add
    and rounding, as `attn_res.ffn_done` does them): the kernels' paths (but kernel 2 adding it itself, which does the
    same in its epilogue: RESIDUAL_IN_DOWN) and `layers.moe.moe` alike."""
    return y if residual is None else (residual + y).astype(residual.dtype)


def _dims(w) -> tuple[int, int, int, int, bool]:
    """(E, I, In, Out, joined) of the block's experts, from w1 | w3 (or their join) and w2."""
    joined = getattr(w, "experts_w13", None) is not None
    E, rows, In = (w.experts_w13 if joined else w.experts_w1).shape
    _, Out, I = w.experts_w2.shape
    return E, I, In, Out, joined


def _f16_marked(w) -> bool:
    """Whether the block's MXFP4 stacks are all marked `f16` (every scale in F16_SCALES, checked at load)."""
    stacks = _stacks(w)
    return bool(stacks) and all(m.f16 for m in stacks)


def _resolve(cf: Config, B: int, In: int, I: int, Out: int, packed: bool = False, x_dtype=jnp.bfloat16,
             f16_ok: bool = False) -> Config:
    """cf with its unset fields chosen: bn x bk = 16 x 256 at B = 1, 32 x 128 for B > 1 (64 x 128 where In <= 2304) and
    128 x 128 for MXFP4 on the tensor cores, 128 x 256 in one stage for the float16 form at B > 1 (the sweep's fastest
    at Kimi-Linear and K3 shapes: docs/PERF.md), or the
    largest smaller powers of two dividing the shapes; MXFP4's scale per group (and the input in float32) for one
    token, per weight for more; MXFP4 for more than one token on the tensor cores where its input allows (bf16, not
    widened, not "bits")."""
    scale = cf.scale or ("group" if B == 1 and cf.decode != "bits" else "weight")  # ("bits" has no group form)
    x_f32 = scale == "group" if cf.x_f32 is None else cf.x_f32
    mx_dot = (packed and B > 1 and not x_f32 and cf.decode != "bits" and jnp.dtype(x_dtype) == jnp.bfloat16
              ) if cf.mx_dot is None else cf.mx_dot
    # dense B > 1: bn 64 where the input is Kimi-Linear's 2304 wide (sixteenth session: the 48B B = 8 step 6822.7 us
    # against 7344.6 at bn 32; at K3's 7168 bn 64 made the stock B = 8 step slower, 4390.6 against 4212.7)
    f16 = bool(packed and (B > 1 and f16_ok and cf.decode != "bits" and jnp.dtype(x_dtype) == jnp.bfloat16
                           if cf.f16 is None else cf.f16))
    bns = ((128, 64, 32, 16) if f16 or (B > 1 and packed and mx_dot) else (16,) if B == 1 else (64, 32, 16)
           if In <= 2304 else (32, 16))
    bn = cf.bn or next((b for b in bns if I % b == 0 and Out % b == 0), 16)
    bk = cf.bk or next((b for b in ((256, 128, 64) if (B == 1 and not f16) or (f16 and B > 1) else (128, 64))
                        if In % b == 0 and I % b == 0), G32)
    # bf16 at B > 1: on where the input is Kimi-Linear's 2304 wide (nineteenth session: the 48B B = 8 step 6616.2 us
    # against 6941.0; alone 194.0 against 211.4), even at K3's 7168 (530.8 against 529.5 alone), so off there
    swap = (f16 and (cf.swap is None or bool(cf.swap))) or (
        not packed and B > 1 and (In <= 2304 if cf.swap is None else bool(cf.swap)))
    stages = cf.num_stages or (1 if f16 else 3)
    return dataclasses.replace(cf, bn=bn, bk=bk, scale=scale, x_f32=x_f32, mx_dot=mx_dot, f16=f16, swap=swap,
                               num_stages=stages)


def _slot_splits(cf: Config, Out: int, I: int, one_mx: bool = False, sms: int = 132) -> int:
    """Kernel 2's programs along the slots: cf.slot_splits, or 4 for MXFP4 at one token (`one_mx`), or with `f16` the
    fewest (up to 4) that bring its grid to 8 programs an SM, else 1."""
    if cf.slot_splits:
        return cf.slot_splits
    if one_mx:
        return 4
    if not cf.f16:
        return 1
    n = (Out // _down_tile(cf)[0]) * _splits(cf, Out, I, sms)
    return next((g for g in range(1, 4) if n * g >= 8 * sms), 4)


def _down_tile(cf: Config) -> tuple[int, int]:
    """Kernel 2's (rows per program, columns per tile): its own down_bn / down_bk, else kernel 1's bn / bk."""
    return cf.down_bn or cf.bn, cf.down_bk or cf.bk


def _splits(cf: Config, Out: int, I: int, sms: int = 132) -> int:
    """Kernel 2's programs along I: cf.splits, or the fewest dividing I's tiles that give >= 4 per SM."""
    bn, bk = _down_tile(cf)
    steps = I // bk
    if cf.splits:
        return cf.splits
    for s in range(1, steps + 1):
        if steps % s == 0 and (Out // bn) * s >= 4 * sms:
            return s
    return steps


def _fold_config(cf: Config, B: int, packed: bool, residual: jax.Array | None, Out: int, I: int,
                 sms: int = 132) -> Config | None:
    """cf as kernel 2 runs it when it adds the residual stream itself (RESIDUAL_IN_DOWN; one token, bf16 experts,
    kernel 2 in one part along I and the slots), else None: splits 1, its rows per program halved from bn (to 4 at
    least) until it has 4 programs an SM (the 48B's L 2304: 576 programs of 4 rows, as many as 144 x 4 parts today),
    its tiles up to FOLD_BK columns."""
    if residual is None or not RESIDUAL_IN_DOWN or B != 1 or packed or cf.splits > 1 or cf.slot_splits > 1:
        return None  # (one token of bf16 experts: never the f16 or swap forms, `_resolve`)
    bn = cf.down_bn or cf.bn
    if not cf.down_bn:
        while bn > 4 and Out // bn < 4 * sms:
            bn //= 2
    bk = cf.down_bk or FOLD_BK
    if not cf.down_bk:
        while bk > G32 and I % bk:
            bk //= 2
    return dataclasses.replace(cf, splits=1, down_bn=bn, down_bk=bk)


def experts(cfg, w, z_BL: jax.Array, w_Bk: jax.Array, ids_Bk: jax.Array, shared: SharedMLP | None = None,
            interpret: bool = False, config: Config | None = None, only_where_faster: bool = True,
            residual: jax.Array | None = None) -> jax.Array:
    """The same function as the reference: fp32 [B, Out] = Σ_k w_k · W2_k act(W1_k z, W3_k z) over the
    local intermediate shard (+ the shared experts' partial); with `residual` [B, Out] (one rank's whole sum: no psum
    after it), bf16(residual + that): at one token with bf16 experts by kernel 2 itself (RESIDUAL_IN_DOWN, kernel 2 in
    one part along I: `_fold_config`), else after the kernels (`add_residual`)."""
    B = z_BL.shape[0]
    E, *_ = _dims(w)
    uniq, coef = plan(ids_Bk, w_Bk, E)
    Bp = _rows_padded(w, z_BL, config)
    # padded slots (B > 1) re-read the last expert (just read by the same program: cached), times 0
    read = uniq if B == 1 else jnp.where(uniq < 0, jnp.max(uniq), uniq)
    coef = w_Bk.astype(F32) if B == 1 else jnp.pad(coef.T, ((0, Bp - B), (0, 0)))  # [Bp, U]: B = 1 as routed
    return _launch(cfg, w, z_BL, [uniq], [read, coef], uniq.shape[0], None, shared, interpret, config, residual)


def experts_routed(cfg, w, z_BL: jax.Array, logits_BE: jax.Array, bias_E: jax.Array,
                   shared: SharedMLP | None = None, interpret: bool = False, config: Config | None = None,
                   only_where_faster: bool = True, residual: jax.Array | None = None) -> jax.Array:
    """`experts` with the router's selection done by the kernels, for one token: the same function as
    `select_experts` (sigmoid, + bias, top-k, renormalise, scale) then `experts_partial`, without XLA's selection
    chain (the sigmoid and add, the TopK sort, the slice, the renormalising sum and product).  Every program of
    kernel 1 ranks the E logits itself (`_route_ranks`) and its programs (u, 0) write slot u's expert and weight,
    which kernel 2 reads as it reads `experts`' ids and coefficients."""
    B, E = logits_BE.shape
    if B != 1:  # routed_fits refuses it; a direct call gets the same words
        raise ValueError(f"moe_experts routed form takes one token, got logits {logits_BE.shape}")
    Ep = 1 << (E - 1).bit_length()
    rt = _Route(E=E, Ep=Ep, k=cfg.num_experts_per_token, renorm=cfg.moe_renormalize,
                scale=float(cfg.routed_scaling_factor), chunk=min(Ep, _Route.chunk))
    logits, bias = logits_BE.astype(F32), bias_E.astype(F32)
    if Ep != E:  # masked in the kernels
        logits, bias = jnp.pad(logits, ((0, 0), (0, Ep - E))), jnp.pad(bias, (0, Ep - E))
    return _launch(cfg, w, z_BL, [logits, bias], None, rt.k, rt, shared, interpret, config, residual)


def _rows_padded(w, z_BL: jax.Array, config: Config | None = None) -> int:
    """The kernels' token rows: 1 (element-wise), 16 (dense, the dot; MXFP4 with `mx_dot`) or B's power of two
    (MXFP4)."""
    B = z_BL.shape[0]
    _, I, In, Out, _ = _dims(w)
    packed = isinstance(w.experts_w2, MXFP4)
    cf = _resolve(config or Config(), B, In, I, Out, packed, z_BL.dtype, _f16_marked(w))
    if cf.swap:  # the weights as the MMA's M side: the tokens are its N, at least 8
        return max(8, 1 << (B - 1).bit_length())
    if packed and cf.f16:
        return 16
    if B == 1 or not packed or cf.mx_dot:
        return 1 if B == 1 else 16
    return 1 << (B - 1).bit_length()


def _launch(cfg, w, z_BL, sel_up: list, sel_down: list | None, U: int, route: _Route | None, shared,
            interpret: bool, config: Config | None, residual: jax.Array | None = None) -> jax.Array:
    """The two pallas_calls over U selected slots (+ the shared experts' slot), the selection given to kernel 1
    as `sel_up` (the ids, or with `route` the logits and bias) and to kernel 2 as `sel_down` (the experts to read
    and their coefficients; with `route`, kernel 1 writes them)."""
    pl = _pl()
    B = z_BL.shape[0]
    E, I, In, Out, joined = _dims(w)
    dt = compute_dtype(w, z_BL)
    w13v, packed = _weight_views(w.experts_w13 if joined else w.experts_w1)
    cf = _resolve(config or Config(), B, In, I, Out, packed, z_BL.dtype, _f16_marked(w))
    w3v = [] if joined else _weight_views(w.experts_w3)[0]
    w2v, _ = _weight_views(w.experts_w2)
    Bp = _rows_padded(w, z_BL, cf)
    decode = "f16" if interpret and cf.decode == "asm" else cf.decode  # interpret mode has no PTX: the same values
    f16 = packed and bool(cf.f16)
    sp = _Spec(Bp=Bp, packed=packed, bn=cf.bn, bk=cf.bk, decode=decode,
               group=packed and cf.scale == "group" and not f16,
               mx_dot=packed and bool(cf.mx_dot) and B > 1 and not f16, f16=f16, swap=bool(cf.swap))
    zp = jnp.pad(z_BL.astype(dt), ((0, Bp - B), (0, 0)))
    if f16:
        xs, xinv = _f16_views(zp)
        xs = [*xs, xinv]
    else:
        xs = _x_views(zp, packed, cf.x_f32)
    s13, s2 = ([shared.gate_up], [shared.down]) if shared is not None else ([], [])
    act = functools.partial(glu, act=cfg.hidden_act, beta=cfg.activation_situ_beta,
                            linear_beta=cfg.activation_situ_linear_beta)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    kw = triton_params(cf.num_warps, cf.num_stages, interpret)
    P = U + (shared is not None)

    if (not interpret and _cuda_wanted(cf)
            and _cuda_problem(cf, w, z_BL, shared, route is not None) is None):  # kernel 1 in CUDA
        form, l2 = _cuda_form(cf, B)
        # raw: the bf16 token as it is (the kernel makes its float16 copy); else the tokens' float16 rows, each times
        # its own 2^k: wide, all B of them (the output padded to the Bp rows a Pallas kernel 2 reads), else the one
        if form == "raw":
            x, xinv = zp[0], None
        else:
            x, xinv = f16_scaled(z_BL.astype(dt))
            x = x if form == "wide" else x[0]
        gate = w.experts_w13 if joined else w.experts_w1
        a, sel = CU.gate_up(sel_up[0], x, xinv, gate, gate if joined else w.experts_w3, I if joined else 0, I,
                            cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta, l2=l2,
                            rows=Bp if form == "wide" else None, stages=_cuda_stages(cf, form, U)), []
    else:
        ins = [*sel_up, *xs, *w13v, *w3v, *s13]
        outs = [jax.ShapeDtypeStruct((P, Bp, I), dt)]
        if route is not None:  # kernel 1 also writes each slot's expert and weights for kernel 2
            outs += [jax.ShapeDtypeStruct((U,), jnp.int32), jax.ShapeDtypeStruct((Bp, U), F32)]
        a, *sel = pl.pallas_call(
            functools.partial(_gate_up_kernel, sp=sp, nsel=len(sel_up), route=route, nx=len(xs) - f16, nw=len(w13v),
                              joined=joined, shared=shared is not None, I=I, steps=In // cf.bk, act=act),
            grid=(P, I // cf.bn), in_specs=[any_] * len(ins), out_specs=[any_] * len(outs),
            out_shape=tuple(outs), interpret=interpret, name="moe_gate_up", **kw)(*ins)

    fcf = _fold_config(cf, B, packed, residual, Out, I)
    cf = fcf or cf
    S, G = _splits(cf, Out, I), _slot_splits(cf, Out, I, packed and B == 1)
    dstages = _cuda_down_stages(cf, B, U)
    Gc = U if dstages else G  # the streaming kernel 2: one slot a part (its items many; the warps split each slot's I)
    if (not interpret and _cuda_wanted(cf, down=True)
            and _cuda_problem(cf, w, z_BL, shared, route is not None, down=(U, Gc, dstages)) is None):  # kernel 2
        _, coef = sel_down if route is None else sel
        ids = sel_up[0]  # (B > 1: -1 for the padding slots, which the kernel skips; `read` re-reads an expert)
        form, l2 = _cuda_form(cf, B)
        wide = form == "wide"  # each slot's Bp rows (past B: zeros, coef 0) with the tokens' coefficients [Bp, U]
        a_U, c = (a, coef) if wide else (a[:, 0, :], coef[0])
        a_U, ainv = (a_U, None) if form == "raw" else f16_scaled(a_U)  # raw: the kernel scales each slot itself
        y = CU.down(ids, c, a_U, ainv, w.experts_w2, Gc, l2=l2, stages=dstages)
        return add_residual((y[0] if Gc == 1 else jnp.sum(y, axis=0))[:B], residual)
    if f16:
        av, ainv = _f16_views(a)
        av = [*av, ainv]
    else:
        av = _x_views(a, packed, cf.x_f32)
    fold = fcf is not None  # (then S = G = 1: _fold_config's splits 1, one slot part)
    ins = [*(sel_down if route is None else sel), *av, *w2v, *s2, *([residual] if fold else [])]
    bn2, bk2 = _down_tile(cf)
    sp2 = dataclasses.replace(sp, bn=bn2, bk=bk2)
    y = pl.pallas_call(
        functools.partial(_down_kernel, sp=sp2, na=len(av) - f16, nw=len(w2v), shared=shared is not None,
                          steps=I // S // sp2.bk, parts=G, fold=fold),
        grid=(Out // sp2.bn, S, G), in_specs=[any_] * len(ins), out_specs=any_,
        out_shape=jax.ShapeDtypeStruct((S * G, Bp, Out), residual.dtype if fold else F32), interpret=interpret,
        name="moe_down", **kw)(*ins)
    if fold:
        return y[0, :B]
    return add_residual((y[0] if S * G == 1 else jnp.sum(y, axis=0))[:B], residual)


def reference(cfg, w, z_BL, w_Bk, ids_Bk, shared: SharedMLP | None = None, config: Config | None = None,
              only_where_faster: bool = True, residual: jax.Array | None = None) -> jax.Array:
    return add_residual(experts_partial(cfg, w, z_BL, w_Bk, ids_Bk, shared), residual)


# (format, B bucket (1 or 8), E (B > 1 only), I, In, Out, shared) -> (kernel us, XLA us), the default Config
# against the reference in the same run (H200; docs/PERF.md).  `fits` lets `auto` take the kernel only where it
# won by MARGIN.  At B > 1 the expert count is part of the key: the kernel reads each *distinct* selected expert
# once where XLA reads B·k matrices, so its gain depends on how many choices coincide (64 experts kept, B = 8,
# top-8: ~41 distinct of 64 choices; all 256 of Kimi-Linear-48B: ~57, where the measured rate would lose).
MEASURED: dict[tuple, tuple[float, float]] = {
    # scripts/gpu/moe_experts_sweep.py, 2026-12-02 (third session), jax 0.11.2: Kimi-Linear-48B TP 1 in the serving
    # layout with the shared experts fused (against XLA's routed + shared experts), K3's TP 2 share; 64 experts kept
    ("bf16", 1, None, 1024, 2304, 2304, True): (59.3, 72.9),
    # bn 64 (sixteenth session; bn 32: 252.0, same run); with `swap` (nineteenth session, call 1): 194.0 against 263.5
    ("bf16", 8, 64, 1024, 2304, 2304, True): (194.0, 263.5),
    ("bf16", 1, None, 1536, 3584, 3584, False): (160.1, 151.8),
    ("bf16", 8, 64, 1536, 3584, 3584, False): (534.5, 1019.5),
    # MXFP4 for B > 1 on the tensor cores (`mx_dot`, the default since; bn 128): the sweep at K3's TP 2 share,
    # 2026-12-04 (fifteenth session: 665.3 us against 1224.7, bn 64 819.7, the element-wise form 1800.3 in the same
    # run; sixteenth, with the "asm" decode: 595.2 against 1209.1, the "f16" decode 658.5).  Kimi-Linear-48B's
    # MXFP4 B = 8 entry (the element-wise form, 721.4 against XLA's 327.5) is dropped: the new default is not measured
    # there
    # On float16 tensor cores (`f16`, the default since for marked stacks): 425.2 us against XLA's 1203.6 and mx_dot's
    # 590.6 in the same run (seventeenth session, call 1); with kernel 2's slots in 4 parts (the default since) 415.2
    # against XLA's 1222.1 (call 6).  The weights as the MMA's M side (`swap`) and 128 x 256 tiles in one stage (the
    # defaults since): 320.2 us against XLA's 1207.4 (eighteenth session, call 9; 3 stages at bk 128: 350.2)
    ("mxfp4", 8, 64, 1536, 3584, 3584, False): (320.2, 1207.4),
    # MXFP4 at B = 1 with the scale per group and the input in float32 (the B = 1 default since): the sweep at K3's
    # TP 2 share, 2026-12-03 (fourteenth session: 145.2 us against 182.1; the scale per weight 187.9); 2026-12-04
    # (sixteenth, the "asm" decode: 119.6 against 176.8, the "f16" decode 141.2); kernel 2's slots in 4 parts (the
    # default since): 105.6 against 179.2 (eighteenth session, call 5; one part 109.6); kernel 1 in CUDA (`cuda`, the
    # default since where the extension has it): 89.4 against 182.0 and the Pallas kernel 1's 105.5 (nineteenth, call 4)
    ("mxfp4", 1, None, 1536, 3584, 3584, False): (89.4, 182.0),
}
# Shapes measured in the decode step rather than alone: (us per step with the kernel, without), same call, H200.
# K3 layers 11-14 at TP 1 (32 experts kept, packed + sharded + one-shot, B = 1, 4K): 2894.9 against XLA's 3273.7
# (fourteenth session, docs/PERF.md; the kernel with the scale per weight: 3313.6).
# K3 layers 11-14 at TP 1, B = 8 (fifteenth session; with and without the kernel in two processes of one call, each
# running both strategies): stock (bf16) 4212.7 against 9839.8, packed (MXFP4 on the tensor cores) 5792.1 against
# 12074.1.  The packed rows again with the "asm" decode (sixteenth session, call 2, one process each): B = 1 2647.3
# against 3252.3, B = 8 4456.6 against 12066.2.  B = 8 on float16 tensor cores (`f16`, seventeenth session, call 1):
# 3869.8 against mx_dot's 4454.9 in the same call (XLA's experts: the sixteenth session's 12066.2); call 6, kernel 2's
# slots in 2 parts (the default since): 3811.6 against one part's 3891.8.  Eighteenth session: B = 8 with `swap` and
# 128 x 256 tiles in one stage 3380.8-3389.1 (call 9; 3605.3-3625.8 before, calls 2-4 and 8); B = 1 with kernel 2's
# slots in 4 parts 2593.8-2613.3 against one part's 2657.6-2661.2 (call 5).  Nineteenth session: B = 1 with kernel 1 in
# CUDA 2524.5 and 2529.7 against 2588.5 and 2591.6 with the Pallas kernel 1 (call 4; call 3, two loads in flight:
# 2545.6, 2555.6 against 2623.6).
STEP_MEASURED: dict[tuple, tuple[float, float]] = {
    ("mxfp4", 1, None, 3072, 3584, 3584, False): (2524.5, 3252.3),
    ("bf16", 8, 32, 3072, 3584, 3584, False): (4212.7, 9839.8),
    ("mxfp4", 8, 32, 3072, 3584, 3584, False): (3389.1, 12066.2),
}
MARGIN = 1.05


def _key(w, B: int, shared) -> tuple:
    """The MEASURED key of a call (the default Config's row; a call with another Config is gated by it too)."""
    E, I, In, Out, _ = _dims(w)
    fmt = "mxfp4" if isinstance(w.experts_w2, MXFP4) else "bf16"
    return fmt, 1 if B == 1 else 8, None if B == 1 else E, I, In, Out, shared is not None


def fits(cfg, w, z_BL, w_Bk, ids_Bk, shared: SharedMLP | None = None, config: Config | None = None,
         only_where_faster: bool = True, residual: jax.Array | None = None, **_) -> str | None:
    E, I, In, Out, _ = _dims(w)
    B = z_BL.shape[0] if z_BL.ndim == 2 else 1
    if residual is not None and (residual.shape != (B, Out) or residual.dtype not in (jnp.bfloat16, jnp.float32)):
        return (f"moe_experts kernel: the residual must be the stream [B, Out] = [{B}, {Out}] in bf16 or float32, got "
                f"{residual.shape} {residual.dtype}")
    packed = isinstance(w.experts_w2, MXFP4)
    cf = _resolve(config or Config(), B, In, I, Out, packed, z_BL.dtype, _f16_marked(w))
    U = plan_slots(E, B, ids_Bk.shape[-1] if ids_Bk is not None else cfg.num_experts_per_token)
    if z_BL.ndim == 2 and _cuda_wanted(cf):  # kernel 1 in CUDA: asked for (Config.cuda), or by default
        why = _cuda_problem(cf, w, z_BL, shared)
        if why is None and cf.cuda_stages:  # an explicit depth the kernel cannot take: refused either way
            why = CU.stream_problem(cf.cuda_stages, U, _cuda_form(cf, B)[0] == "raw")
        elif not cf.cuda:
            why = None  # (by default the Pallas kernel 1 takes a call the CUDA kernel cannot)
        if why:
            return f"moe_experts kernel: {'cuda' if cf.cuda else 'cuda_stages'}: {why}"
    if cf.cuda_down and z_BL.ndim == 2:
        ds = _cuda_down_stages(cf, B, U)
        why = _cuda_problem(cf, w, z_BL, shared, down=(U, U if ds else _slot_splits(cf, Out, I, B == 1), ds))
        if why is None and ds:
            why = CU.stream_problem(ds, U, False, CU.DOWN_TARGET)
        if why:
            return f"moe_experts kernel: cuda_down: {why}"
    if cf.f16 and not _f16_marked(w):
        return (f"moe_experts kernel: f16 needs MXFP4 stacks whose scales all lie in {list(F16_SCALES)} (MXFP4.f16: "
                f"the config's experts_f16, set at load; these are not marked)")
    if cf.f16 and (cf.decode == "bits" or z_BL.dtype != jnp.bfloat16):
        return (f"moe_experts kernel: f16 takes bf16 activations (their 8 significant bits are float16's exactly) and "
                f"the 'asm', 'f16' or 'select' decode, got {z_BL.dtype}, decode {cf.decode!r}")
    min_bn = 8 if B == 1 else 16  # one token: element-wise [bn, bk] tiles; more: the dot's 16-row tiles
    if not (pow2(cf.bn) and pow2(cf.bk)) or cf.bk < G32 or cf.bn < min_bn:
        return (f"moe_experts kernel needs bn >= {min_bn} (B = {B}) and bk >= {G32}, powers of two (Triton blocks), "
                f"got {cf.bn}, {cf.bk}")
    if cf.decode not in DECODES:
        return f"moe_experts kernel: decode must be one of {DECODES}, got {cf.decode!r}"
    if cf.scale not in ("weight", "group") or (cf.scale == "group" and cf.decode == "bits"):
        return (f"moe_experts kernel: scale must be 'weight' or 'group' (the latter with the 'f16', 'asm' or 'select' "
                f"decode), got {cf.scale!r} with {cf.decode!r}")
    if z_BL.ndim != 2 or not 1 <= z_BL.shape[0] <= MAX_B:
        return f"moe_experts kernel is for decode (1 to {MAX_B} tokens), got z {z_BL.shape}"
    if packed and cf.mx_dot and B > 1 and (cf.decode == "bits" or cf.x_f32 or z_BL.dtype != jnp.bfloat16):
        return (f"moe_experts kernel: mx_dot takes bf16 activations (not widened: x_f32 off) and the 'f16', 'asm' or "
                f"'select' decode, got {z_BL.dtype}, x_f32 {cf.x_f32}, decode {cf.decode!r}")
    if not packed and w.experts_w2.dtype != jnp.bfloat16:
        return f"moe_experts kernel streams bf16 or MXFP4 experts, got {w.experts_w2.dtype}"
    lo_bn = 4 if B == 1 and not (cf.f16 or cf.swap) else 16  # (one token's element-wise tiles: 4 rows, `_fold_config`)
    if not ((cf.down_bn == 0 or (pow2(cf.down_bn) and cf.down_bn >= lo_bn))
            and (cf.down_bk == 0 or (pow2(cf.down_bk) and cf.down_bk >= G32))):
        return (f"moe_experts kernel: kernel 2's down_bn (>= {lo_bn} at B = {B}) and down_bk (>= {G32}) must be "
                f"powers of two, or 0 for bn and bk, got {cf.down_bn}, {cf.down_bk}")
    cf = _fold_config(cf, B, packed, residual, Out, I) or cf
    bn2, bk2 = _down_tile(cf)
    S = _splits(cf, Out, I) if I % bk2 == 0 else 1  # (a bk not dividing I is refused below)
    for name, rows, cols, bn, bk in (("w1/w3", I, In, cf.bn, cf.bk), ("w2", Out, I, bn2, bk2)):
        if rows % bn or cols % bk:
            return (f"moe_experts kernel needs {name} rows a multiple of bn {bn} and columns of bk {bk}, "
                    f"got [{rows}, {cols}]")
    if I % (S * bk2):
        return f"moe_experts kernel: {S} splits of I {I} in tiles of {bk2} do not divide it"
    if shared is not None:
        if packed:
            return "moe_experts kernel fuses the shared experts with bf16 routed experts only (these are MXFP4)"
        if (shared.gate_up.shape != (2 * I, In) or shared.down.shape != (Out, I)
                or shared.gate_up.dtype != w.experts_w2.dtype or shared.down.dtype != w.experts_w2.dtype):
            return (f"moe_experts kernel fuses shared experts of the routed experts' shapes and dtype (gate_up "
                    f"[{2 * I}, {In}], down [{Out}, {I}]), got {shared.gate_up.shape} {shared.gate_up.dtype}, "
                    f"{shared.down.shape} {shared.down.dtype}")
    if cf.slot_splits < 0 or (_slot_splits(cf, Out, I, packed and B == 1) > 1 and shared is not None):
        return (f"moe_experts kernel: slot_splits must be >= 0, and 1 with the shared experts fused, got "
                f"{cf.slot_splits}")
    if only_where_faster:
        key = _key(w, z_BL.shape[0], shared)
        m = MEASURED.get(key) or STEP_MEASURED.get(key)
        if m is None:
            return f"moe_experts kernel: {key} not measured against XLA on an H200 (kernels='on' runs it)"
        if m[1] / m[0] < MARGIN:
            return f"moe_experts kernel: XLA is as fast at {key} on an H200 (kernel {m[0]} us, XLA {m[1]} us)"
    return None


# Proven on an H200 (2026-12-02, third session): its compiled tests pass (tests/test_kernels.py: tiny dims in three
# tilings, each decode; tests/test_kernels_real.py at K3 TP 1/2/8 and Kimi-Linear-48B, bf16 and MXFP4, B 1 and 8,
# MXFP4 with the select decode: the f16 default was compiled at tiny dims only), and `fits` lets auto take it only
# at the shapes where it beat XLA (MEASURED): bf16 at Kimi-Linear B 1 and, with 64 experts kept, B 8 and K3 B 8.
register(Kernel("moe_experts", reference, experts, platforms=("gpu",), fits=fits,
                measured="bf16: 1.23x XLA at Kimi-Linear-48B B=1 and 1.25x at B=8 (serving layout, shared experts "
                         "fused, bn 64; the 48B B=8 step 6839.8 us, 1.39x its floor, against 7344.6 at bn 32), 1.91x "
                         "at K3 TP 2 B=8, 0.95x at K3 TP 2 B=1 (auto keeps XLA; B=8 with 64 experts kept); MXFP4 "
                         "(the \"asm\" decode): 2.04x at K3 TP 2 B=1 with kernel 1 in CUDA (tensor cores, "
                         "jaxk3.kernels.mxfp4_cuda; the Pallas form 1.73x; K3 layers 11-14 at TP 1, packed: the "
                         "step 2524.5 us against 2588.5 with the Pallas kernel 1 and XLA's 3252.3; with the L2 hint "
                         "2.03x at K3 TP 2 B=1); 2.94x at K3 TP 2 B=8 on float16 tensor cores (f16; mx_dot 2.04x), "
                         "4.07x with kernel 1 in CUDA (wide; the K3 layers 11-14 packed B=8 step 3259.9 us with the L2 "
                         "hint against 3350.3 with the Pallas kernel 1); K3 layers 11-14 at TP 1, B=8: the step 4212.7 "
                         "us against 9839.8 (bf16) and 3811.6 against 12066.2 (MXFP4; mx_dot 4454.9) (H200, jax "
                         "0.11.2; MEASURED, STEP_MEASURED); kernel 1's streaming form: 2.05x XLA at K3 TP 2 B=1 with 4 "
                         "stages (88.0 us against 180.1; the register form 1.90x), 3.78x at B=8 with 8 (327.9 against "
                         "1238.8; 3.61x), the K3 layers 11-14 packed steps 3218.8-3258.9 us at B=1 and 4162.5-4191.6 "
                         "at B=8 against 3242.9-3289.8 and 4256.8-4274.6 with the register form (H100, jax 0.11.2); "
                         "kernel 2 adding the residual stream at one token (RESIDUAL_IN_DOWN): the 48B B=1 step "
                         "2921.1-2927.1 us with 237 launches against 2917.5-2938.0 with 262 (H100, jax 0.11.2)"))


def routed_reference(cfg, w, z_BL, logits_BE, bias_E, shared: SharedMLP | None = None, config: Config | None = None,
                     only_where_faster: bool = True, residual: jax.Array | None = None) -> jax.Array:
    """`experts_routed`'s function in jnp: the router's `select_experts`, then `experts_partial` (and the residual)."""
    from jaxk3.kernels.router import select_experts

    w_Bk, ids_Bk = select_experts(cfg, logits_BE, bias_E)
    return add_residual(experts_partial(cfg, w, z_BL, w_Bk, ids_Bk, shared), residual)


MAX_ROUTED_EXPERTS = 256  # the ranks compare every pair of the Ep logits: [Ep, 32] tiles per program
# (format, B bucket, E, I, In, Out, shared) where the whole step was measured faster with the selection in the kernels
# than with XLA's chain before `moe_experts` (docs/PERF.md); `auto` takes the routed form only there.
# Measured 2026-12-02 (fifth session, call 3, kernel 2 reading kernel 1's choices): the 48B step (64 experts kept,
# TP 1, B = 1) 2465.5 us with it against 2647.1 without in the same call, 391 launch ops against 521 (call 1, both
# kernels ranking: 2519.8 vs 2632.7).  B = 8 (call 2, every program planning the distinct experts): 9130.6 us against
# 7402.9, slower; a second B > 1 form (one planning kernel before the two, sixth session) 8318.0 against 7425.6, slower:
# both removed, the routed form is for one token.  All 256 experts (8 comparison tiles per program instead of 2, sixth
# session, `bench generate` at B = 1 in the same call's two processes): 320.1 decode tokens/s with it against 381.3
# without: slower, not taken.
ROUTED_MEASURED: set[tuple] = {("bf16", 1, 64, 1024, 2304, 2304, True)}


def routed_fits(cfg, w, z_BL, logits_BE, bias_E, shared: SharedMLP | None = None, config: Config | None = None,
                only_where_faster: bool = True, residual: jax.Array | None = None, **_) -> str | None:
    """Why this call does not suit `experts_routed` (None: it does): `moe_experts`' own conditions, one token, an
    ungrouped top-k over at most MAX_ROUTED_EXPERTS logits of this block's experts; `auto` takes it only where the
    step was measured faster with it (`ROUTED_MEASURED`)."""
    if cfg.use_grouped_topk and cfg.num_expert_group > 1:
        return f"moe_experts routed form has no group-limited selection (num_expert_group {cfg.num_expert_group})"
    E = _dims(w)[0]
    if config is not None and (config.cuda or config.cuda_down):
        return "moe_experts routed form: its kernel 1 ranks the router's logits; the CUDA kernels (cuda, cuda_down) do not"
    why = fits(cfg, w, z_BL, None, None, shared=shared, config=config, only_where_faster=False, residual=residual)
    if why:
        return why
    B = z_BL.shape[0]
    if logits_BE.shape != (B, E) or bias_E.shape != (E,):
        return (f"moe_experts routed form: logits [{B}, {E}] and bias [{E}] for {B} tokens and the block's {E} "
                f"experts, got {logits_BE.shape} and {bias_E.shape}")
    k = cfg.num_experts_per_token
    if not 1 <= k <= E or E > MAX_ROUTED_EXPERTS:
        return (f"moe_experts routed form ranks 1 <= k <= E <= {MAX_ROUTED_EXPERTS} experts in registers, got k {k}, "
                f"E {E}")
    if B != 1:
        return (f"moe_experts routed form takes one token (both B > 1 forms made the 48B step slower on an H200 and "
                f"were removed), got {B}")
    if only_where_faster:
        fmt, bb, _, I, In, Out, sh = _key(w, B, shared)
        key = (fmt, bb, E, I, In, Out, sh)
        if key not in ROUTED_MEASURED:
            return (f"moe_experts routed form: the step at {key} was not measured faster with it on an H200 "
                    "(kernels='on' runs it)")
    return None


# Proven on an H200 (2026-12-02, fifth and sixth sessions): compiled at Kimi-Linear-48B's dims with 64 and 256
# experts (tests/test_kernels.py::test_moe_experts_routed_on_gpu), and the 48B step at B = 1 (64 experts) 6.9% faster.
register(Kernel("moe_experts_routed", routed_reference, experts_routed, platforms=("gpu",), fits=routed_fits,
                measured="B=1, Kimi-Linear-48B TP 1, 64 experts: the step 6.9% faster with it (2465.5 vs 2647.1 us, "
                         "130 fewer kernels); 256 experts: decode 16% slower (auto keeps XLA's selection); B>1: two "
                         "forms 12-23% slower, removed (H200, jax 0.11.2, 2026-12-02)"))
