"""The prefill MoE's two grouped GEMMs (jaxk3.kernels.moe_grouped) in Pallas Mosaic GPU: TMA loads into swizzled
shared memory through a multi-stage pipeline (`plgpu.emit_pipeline`) and `wgmma` on Hopper's tensor cores, where the
Triton form (`tl.dot` over cp.async loads) reached 255-278 TFLOP/s at Kimi-Linear-48B's prefill (docs/PERF.md).

The same block-aligned layout as the Triton kernels (`moe_grouped.align`: every bm-row block belongs to one expert,
`expert_B[b]`, -1 for an unused block), with the inputs copied into that order first (`prepare` without `gather`: TMA
loads whole tiles, not rows by index).  A persistent grid of one program per SM walks the (row block, output tile)
pairs; each pair reads its expert's weight tiles and skips an unused block:

    gate_up  a[r, n-tile] = act(x[r] W1_e^T, x[r] W3_e^T)    two accumulators over L / bk steps    [M, I] bf16
    down     y[r, n-tile] = a[r] W2_e^T                       one accumulator over I / bk steps      [M, L] fp32

Weights stay as stored ([E, O, In]: the wgmma reads each [bn, bk] tile transposed in shared memory).  bm is a
multiple of 64 (a warpgroup's wgmma rows) and bk 64 (128-byte rows of bf16: the widest swizzle).

Interpret mode (tests on the CPU) is Mosaic GPU's own interpreter (`plgpu.InterpretGPUParams`, jax >= 0.11).

Measured on an H200 at Kimi-Linear-48B's prefill (4096 tokens x 8 of 256 experts; docs/PERF.md, sixteenth session):
the two kernels 1.899-1.941 ms a layer (`gate_up_ws` 1.912-1.917), against the Triton kernels' 1.815-1.819, with the
same output bit for bit.  What bounds both, by the counts, is the weight tiles each 64-row block loads from L2 (12 GB a
layer against the plain GEMM's 5.4 GB for the same FLOPs); a cluster of two blocks sharing each tile by TMA multicast is
the next form.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32


def _mods():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return pl, plgpu


def transposed(ref, perm: tuple[int, ...]):
    """A shared-memory ref viewed with its dims permuted, for wgmma's B operand: `ref.transpose(perm)` (jax >= 0.11.2;
    jax 0.12.1 removed the older `plgpu.transpose_ref`, which 0.11 has)."""
    if hasattr(ref, "transpose"):
        return ref.transpose(perm)
    return _mods()[1].transpose_ref(ref, perm)  # pragma: no cover - jax < 0.11.2


def num_sms() -> int:
    """The persistent grid: one program per SM (132 on an H200; the CPU's interpreter takes the same)."""
    d = jax.devices()[0]
    return int(getattr(d, "core_count", 0) or 132) if d.platform == "gpu" else 132


def interpret_params():
    """Mosaic GPU's interpreter, or None where this jax has none (jax 0.10)."""
    _, plgpu = _mods()
    p = getattr(plgpu, "InterpretGPUParams", None)
    return None if p is None else p()


def _kernel(body, out_type, interpret: bool, **mesh):
    """plgpu.kernel over a persistent grid of one program per SM (`mesh`: warpgroups, e.g. num_threads)."""
    _, plgpu = _mods()
    kw = {}
    if interpret:
        p = interpret_params()
        if p is None:
            raise NotImplementedError("moe_grouped_mgpu: this jax has no Mosaic GPU interpreter (jax >= 0.11 has)")
        kw["interpret"] = p
    return plgpu.kernel(body, out_type=out_type, grid=(num_sms(),), grid_names=("sm",),
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                        **mesh, **kw)


def _tiles(loop_index, nb: int, n_tiles: int, width: int):
    """(row block, output tile) of a persistent loop's index: a planar snake, `width` output tiles wide."""
    _, plgpu = _mods()
    return plgpu.planar_snake(loop_index, (nb, n_tiles), 1, width)


def _each_tile(expert_gmem, n_tiles: int, width: int, fn) -> None:
    """The persistent loop: this SM's share of the (row block, output tile) pairs, fn(mi, ni, e) for each pair whose
    block is used (its expert e = expert_B[mi] >= 0)."""
    pl, plgpu = _mods()
    nb = expert_gmem.shape[0]

    @plgpu.nd_loop((nb * n_tiles,), collective_axes="sm")
    def _(info):
        mi, ni = _tiles(info.index[0], nb, n_tiles, width)
        e = expert_gmem[mi]

        @pl.when(e >= 0)
        def _():
            fn(mi, ni, e)


def _store(acc_value, out_gmem, mi, ni, bm: int, bn: int) -> None:
    """A [bm, bn] tile into out[mi·bm :, ni·bn :] through shared memory (a TMA store), waited for."""
    pl, plgpu = _mods()

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), out_gmem.dtype))
    def _(o_smem):
        o_smem[...] = acc_value.astype(out_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gate_up(expert_B: jax.Array, xs_ML: jax.Array, w1: jax.Array, w3: jax.Array, off3: int, I: int, act_fn, *,
            bm: int, bn: int, bk: int, stages: int, width: int, interpret: bool = False) -> jax.Array:
    """a [M, I] (xs' dtype) = act(xs W1_e^T, xs W3_e^T) per bm-row block of expert e = expert_B[b] (rows of unused
    blocks left unwritten); w1, w3 [E, ·, L] with the up rows at `off3` of w3 (a multiple of bn)."""
    pl, plgpu = _mods()
    M, L = xs_ML.shape
    n_tiles, steps, off = I // bn, L // bk, off3 // bn

    def body(expert_gmem, x_gmem, w1_gmem, w3_gmem, a_gmem):
        def tile(mi, ni, e):
            def scope(acc1, acc3):
                def step(_, x_s, w1_s, w3_s):
                    plgpu.wgmma(acc1, x_s, transposed(w1_s, (1, 0)))
                    plgpu.wgmma(acc3, x_s, transposed(w3_s, (1, 0)))

                plgpu.emit_pipeline(
                    step, grid=(steps,),
                    in_specs=[plgpu.BlockSpec((bm, bk), lambda k: (mi, k), delay_release=1),
                              plgpu.BlockSpec((bn, bk), lambda k: (ni, k), delay_release=1),
                              plgpu.BlockSpec((bn, bk), lambda k: (off + ni, k), delay_release=1)],
                    max_concurrent_steps=stages)(x_gmem, w1_gmem.at[e], w3_gmem.at[e])
                return acc1[...], acc3[...]

            h1, h3 = pl.run_scoped(scope, plgpu.ACC((bm, bn)), plgpu.ACC((bm, bn)))
            _store(act_fn(h1, h3), a_gmem, mi, ni, bm, bn)

        _each_tile(expert_gmem, n_tiles, width, tile)

    return _kernel(body, jax.ShapeDtypeStruct((M, I), xs_ML.dtype), interpret)(expert_B, xs_ML, w1, w3)


def down(expert_B: jax.Array, a_MI: jax.Array, w2: jax.Array, *, bm: int, bn: int, bk: int, stages: int, width: int,
         interpret: bool = False) -> jax.Array:
    """y [M, L] fp32 = a W2_e^T per bm-row block of expert e = expert_B[b]; w2 [E, L, I]."""
    pl, plgpu = _mods()
    M, I = a_MI.shape
    L = w2.shape[1]
    n_tiles, steps = L // bn, I // bk

    def body(expert_gmem, a_gmem, w2_gmem, y_gmem):
        def tile(mi, ni, e):
            def scope(acc):
                plgpu.emit_pipeline(
                    lambda _, a_s, w_s: plgpu.wgmma(acc, a_s, transposed(w_s, (1, 0))),
                    grid=(steps,),
                    in_specs=[plgpu.BlockSpec((bm, bk), lambda k: (mi, k), delay_release=1),
                              plgpu.BlockSpec((bn, bk), lambda k: (ni, k), delay_release=1)],
                    max_concurrent_steps=stages)(a_gmem, w2_gmem.at[e])
                return acc[...]

            _store(pl.run_scoped(scope, plgpu.ACC((bm, bn))), y_gmem, mi, ni, bm, bn)

        _each_tile(expert_gmem, n_tiles, width, tile)

    return _kernel(body, jax.ShapeDtypeStruct((M, L), F32), interpret)(expert_B, a_MI, w2)


def gate_up_ws(expert_B: jax.Array, xs_ML: jax.Array, w1: jax.Array, w3: jax.Array, off3: int, I: int, act_fn, *,
               bm: int, bn: int, bk: int, stages: int, width: int, interpret: bool = False) -> jax.Array:
    """`gate_up` warp-specialised: a memory warpgroup issues the TMA loads while two compute warpgroups each multiply
    half of the bn output columns (bn / 2 each, two accumulators), so loads run ahead across the K steps without the
    compute warpgroups issuing them.  The same function as `gate_up`."""
    pl, plgpu = _mods()
    M, L = xs_ML.shape
    n_tiles, steps, off = I // bn, L // bk, off3 // bn
    half = bn // 2

    def body(expert_gmem, x_gmem, w1_gmem, w3_gmem, a_gmem):
        wg = jax.lax.axis_index("wg")

        def pipeline(step_fn, context):
            return plgpu.emit_pipeline_warp_specialized(
                step_fn, grid=(steps,), memory_registers=40,
                in_specs=[plgpu.BlockSpec((bm, bk), lambda k: (0, k)),
                          plgpu.BlockSpec((bn, bk), lambda k: (0, k)),
                          plgpu.BlockSpec((bn, bk), lambda k: (0, k))],
                wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages, compute_context=context)

        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(pl.run_scoped,
                           allocs=pipeline(ignore, ignore).get_allocations(
                               x_gmem.at[pl.ds(0, bm)], w1_gmem.at[0, pl.ds(0, bn)], w3_gmem.at[0, pl.ds(0, bn)]),
                           o_smem=plgpu.SMEM((2, bm, half), a_gmem.dtype), collective_axes="wg")
        def _(allocs, o_smem):
            def tile(mi, ni, e):
                cols = pl.ds(wg * half, half)

                def context(run):
                    @functools.partial(pl.run_scoped, acc1=plgpu.ACC((bm, half)), acc3=plgpu.ACC((bm, half)))
                    def _(acc1, acc3):
                        run((acc1, acc3))
                        y = act_fn(acc1[...], acc3[...]).astype(a_gmem.dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        o_smem[wg] = y
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            o_smem.at[wg], a_gmem.at[pl.ds(mi * bm, bm), pl.ds(ni * bn + wg * half, half)])

                def step(_, x_s, w1_s, w3_s, carry):
                    acc1, acc3 = carry
                    plgpu.wgmma(acc1, x_s, transposed(w1_s.at[cols], (1, 0)))
                    plgpu.wgmma(acc3, x_s, transposed(w3_s.at[cols], (1, 0)))
                    plgpu.wgmma_wait(0)
                    return carry

                pipeline(step, context)(
                    x_gmem.at[pl.ds(mi * bm, bm)], w1_gmem.at[e, pl.ds(ni * bn, bn)],
                    w3_gmem.at[e, pl.ds((off + ni) * bn, bn)], allocations=allocs)

            _each_tile(expert_gmem, n_tiles, width, tile)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _kernel(body, jax.ShapeDtypeStruct((M, I), xs_ML.dtype), interpret, num_threads=3, thread_name="wg")(
        expert_B, xs_ML, w1, w3)
