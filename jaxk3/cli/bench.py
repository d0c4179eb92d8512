"""`jaxk3 bench gather | decode | generate | kernels`: the benchmarks (jaxk3.tools), each with its
baseline in the same run."""
from __future__ import annotations

import argparse
import json
import os
import sys

from jaxk3.cli.common import (MAX_CPU_DEVICES, choices_list, config_problem, cpu_devices_arg, fail, int_in,  # noqa: F401
                              one_line, parse_ints, parse_sizes, positive, progress, write_json)


def variants_list(text: str) -> tuple[tuple[str, str], ...]:
    """`checkpoint/off,serving/auto` -> (("checkpoint", "off"), ("serving", "auto"))."""
    out = []
    for item in text.split(","):
        lay, _, ker = item.strip().partition("/")
        if lay not in ("auto", "serving", "checkpoint") or ker not in ("auto", "off", "on"):
            raise argparse.ArgumentTypeError(f"{item!r}: need LAYOUT/KERNELS, LAYOUT one of auto, serving, "
                                             "checkpoint and KERNELS one of auto, off, on (e.g. checkpoint/off)")
        out.append((lay, ker))
    return tuple(dict.fromkeys(out))


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (same-run baselines, ratios printed)")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    g = bsub.add_parser("gather", help="per-step latency of the collectives: FFI path vs lax.all_gather / lax.psum vs "
                        "two no-exchange floors (XLA tile, one FFI call), unrolled chains and lax.scan bodies")
    g.add_argument("--sizes", type=parse_sizes, default=None,
                   help="payload bytes per rank, comma separated (default 64,256,1k,4k,16k,64k,256k)")
    g.add_argument("--chain", type=int_in(1, 10_000), default=100,
                   help="dependent gathers per jitted program, 1..10000 (default 100)")
    g.add_argument("--repeats", type=int_in(1, 10_000), default=15,
                   help="timed runs per size; the median is reported (default 15)")
    g.add_argument("--devices", type=positive, default=None, help="use the first N devices (default: all)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "int8"])
    g.add_argument("--ops", type=choices_list(("gather", "allreduce")), default=("gather", "allreduce"),
                   help="comma list: gather, allreduce (default both)")
    g.add_argument("--forms", type=choices_list(("unrolled", "scan")), default=("unrolled", "scan"),
                   help="comma list: unrolled (a chain unrolled in one jit), scan (the chain in lax.scan); default both")
    g.add_argument("--load", type=int_in(0, 64), default=0,
                   help="busy processes (pure CPU spinners) to run beside the chains while they are measured, "
                   "0..64; killed after (default 0)")
    g.add_argument("--json", dest="json_path", default=None, help="write the full result to this JSON file")
    cpu_devices_arg(g)

    d = bsub.add_parser("decode", help="decode-step latency of a layer slice, four strategies, vs the "
                        "bandwidth floor")
    d.add_argument("--config", default="k3",
                   help="k3 | kimi-linear-48b | tiny | PATH to a HF config.json / model dir (default k3)")
    d.add_argument("--layers", default=None,
                   help="0-based inclusive layer slice, e.g. 11-14 (K3 default: 11-14; 'all' for every layer)")
    d.add_argument("--experts", type=positive, default=None,
                   help="routed experts kept per MoE layer (memory; per-token work unchanged; K3 default 32)")
    d.add_argument("--tp", type=positive, default=None, help="TP size (default: all devices)")
    d.add_argument("--batch", type=parse_ints, default=(1, 8), help="batch sizes, comma separated (default 1,8)")
    d.add_argument("--context", type=parse_ints, default=(4096, 32768),
                   help="MLA context lengths, comma separated, k = 1024 (default 4k,32k)")
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    d.add_argument("--steps", type=int_in(1, 100_000), default=20,
                   help="back-to-back steps per timing, 1..100000 (default 20)")
    d.add_argument("--repeats", type=int_in(1, 10_000), default=5,
                   help="timings per case; the median is reported (default 5)")
    d.add_argument("--kernels", type=choices_list(("auto", "off", "on")), default=("auto",),
                   help="device kernel modes, comma separated: each strategy runs under each (default auto)")
    d.add_argument("--layouts", type=choices_list(("auto", "serving", "checkpoint")), default=("auto",),
                   help="weight layouts, comma separated: each strategy runs in each (auto: serving on GPUs, "
                   "checkpoint on CPUs; default auto)")
    d.add_argument("--variants", type=variants_list, default=None,
                   help="layout/kernels pairs, comma separated, e.g. checkpoint/off,serving/auto: each strategy runs "
                   "in each pair (instead of the product of --layouts and --kernels)")
    d.add_argument("--strategies", default=None, help="subset, comma separated: stock,sharded+lax,sharded+one-shot,packed+sharded+one-shot")
    d.add_argument("--copy-mb", type=int_in(1, 1 << 20), default=1024,
                   help="per-device size of the bandwidth copy in MiB (default 1024)")
    d.add_argument("--hlo-dir", default=None, help="write each compiled step's optimized HLO here")
    d.add_argument("--census", action="store_true",
                   help="instead of latencies: kernels per block (embed, each layer's attention and ffn, head) by "
                   "kind from the compiled step's HLO, and device time per block from a profile of --steps steps")
    d.add_argument("--target", default=None, choices=["h200"],
                   help="with --census: compile each step for --tp devices of this kind, which this machine need not "
                   "have (XLA's deviceless compile; needs jax's CUDA plugin: `make aot`), and census its kernels; no "
                   "times. A kernel that does not fit the device fails here as it would there")
    d.add_argument("--json", dest="json_path", default=None, help="write the full result to this JSON file")
    d.add_argument("--plot", default=None, help="write a PNG of latency per strategy and batch (matplotlib)")
    cpu_devices_arg(d)
    from jaxk3 import distributed

    distributed.add_cli_args(d)

    gen = bsub.add_parser("generate", help="prefill + decode loop at real dimensions: TTFT, prefill and decode "
                          "tokens/s, the back-to-back step rate and the bandwidth floor, same run")
    gen.add_argument("--config", default="kimi-linear-48b",
                     help="kimi-linear-48b | k3 | tiny | PATH to a HF config.json / model dir (default kimi-linear-48b)")
    gen.add_argument("--tp", type=int_in(1, 1024), default=1, help="TP size (default 1)")
    gen.add_argument("--batch", type=parse_ints, default=(1, 8), help="batch sizes, comma separated (default 1,8)")
    gen.add_argument("--prompt", type=int_in(1, 1 << 20), default=4096, help="prompt tokens per row (default 4096)")
    gen.add_argument("--new", type=int_in(2, 1 << 20), default=256, help="new tokens per row (default 256)")
    gen.add_argument("--experts", type=int_in(1, 1 << 16), default=None,
                     help="routed experts kept per MoE layer (memory; per-token work unchanged while >= B*k)")
    gen.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    gen.add_argument("--prefill-chunk", type=int_in(64, 1 << 16), default=None,
                     help="prompt tokens per row per prefill dispatch, a multiple of 64 (default: the chunk "
                          "Model.generate picks, by the balance of weight bytes and FLOPs)")
    gen.add_argument("--baseline-chunk", type=int_in(64, 1 << 16), default=None,
                     help="also time the prefill with every device kernel off at this chunk, same weights, same "
                          "run (512: the path before the grouped-GEMM MoE and the chunk choice)")
    gen.add_argument("--breakdown", action="store_true",
                     help="also the prefill's device time by block (embed, kda, mla, moe, mlp, head) from a profile")
    gen.add_argument("--decode-chunk", type=int_in(1, 1 << 16), default=64,
                     help="new tokens per decode dispatch (default 64)")
    gen.add_argument("--psum", default="lax", choices=["auto", "ffi", "lax"], help="row-parallel sums (default lax)")
    gen.add_argument("--copy-mb", type=int_in(1, 1 << 20), default=1024,
                     help="per-device size of the bandwidth copy in MiB (default 1024)")
    gen.add_argument("--json", dest="json_path", default=None, help="write the full result to this JSON file")
    gen.add_argument("--plot", default=None, help="write a PNG (matplotlib)")
    cpu_devices_arg(gen)

    kb = bsub.add_parser("kernels", help="each device kernel against the XLA path it replaces, real sizes, same run")
    kb.add_argument("--config", default="k3", help="k3 | kimi-linear-48b | tiny | PATH (default k3)")
    kb.add_argument("--tp", type=positive, default=2, help="the TP rank's share of the experts (default 2)")
    kb.add_argument("--experts", type=int_in(1, 1 << 16), default=64,
                    help="routed experts kept per layer (memory; default 64)")
    kb.add_argument("--batch", type=parse_ints, default=(1, 8), help="batch sizes, comma separated (default 1,8)")
    kb.add_argument("--chain", type=int_in(1, 10_000), default=20, help="dependent calls per timing (default 20)")
    kb.add_argument("--repeats", type=int_in(1, 10_000), default=5, help="timings per case, median taken (default 5)")
    kb.add_argument("--json", dest="json_path", default=None, help="write the full result to this JSON file")
    cpu_devices_arg(kb)


def check_args(args) -> str | None:
    """What argparse's per-option types cannot see in `jaxk3 bench ...`: the problem, one line, or None."""
    if getattr(args, "config", None) is not None and (problem := config_problem(args.config)):
        return problem  # decode, generate, kernels
    if args.bench_cmd == "decode":
        if args.census and args.plot:
            return "--plot: not with --census (the census is a table; --json keeps it)"
        if args.target and not args.census:
            return "--target: only with --census (a step compiled for a device this machine lacks cannot be timed)"
        if args.target and args.coordinator:
            return "--target: compiles in one process; not with --coordinator"
        if args.hlo_dir is not None and os.path.exists(args.hlo_dir) and not os.path.isdir(args.hlo_dir):
            return f"--hlo-dir {args.hlo_dir}: exists and is not a directory"
    return None


def gather(args) -> int:
    import jax
    import jax.numpy as jnp

    from jaxk3.tools import bench_gather as bench

    devices = jax.devices()
    if args.devices is not None:
        if not 1 <= args.devices <= len(devices):
            return fail("jaxk3 bench gather", f"--devices {args.devices}: only {len(devices)} devices present")
        devices = devices[: args.devices]
    sizes = args.sizes or bench.DEFAULT_SIZES

    result = bench.bench_collectives(sizes=sizes, chain=args.chain, repeats=args.repeats, devices=devices,
                                     dtype=jnp.dtype(args.dtype), progress=progress, ops=args.ops, forms=args.forms,
                                     load=args.load)
    print(bench.gather_table(result))
    if args.json_path:
        return write_json(bench.write_json, result, args.json_path, "jaxk3 bench gather")
    return 0


def decode(args) -> int:
    import jax

    from jaxk3 import distributed
    from jaxk3.kernels import KernelUnavailableError
    from jaxk3.tools.aot import TargetUnavailable

    cmd = "jaxk3 bench decode"
    if args.target:
        from jaxk3.tools import aot

        aot.prepare()  # before jax starts its backends
    try:
        distributed.initialize_from_args(args)
    except ValueError as e:
        return fail(cmd, e)
    from jaxk3.tools import bench_decode as bd

    k3 = args.config == "k3"
    layers = args.layers if args.layers is not None else ("11-14" if k3 else None)
    experts = args.experts if args.experts is not None else (32 if k3 else None)
    strategies = bd.STRATEGIES
    if args.strategies:
        want = [s.strip() for s in args.strategies.split(",")]
        unknown = [s for s in want if s not in {st.name for st in bd.STRATEGIES}]
        if unknown:
            return fail(cmd, f"--strategies: unknown {unknown}")
        strategies = tuple(s for s in bd.STRATEGIES if s.name in want)
    if args.variants:
        strategies = bd.with_variants(strategies, args.variants)
    else:
        strategies = bd.with_kernels(bd.with_layouts(strategies, args.layouts), args.kernels)
    if args.census:
        try:
            result = bd.census_decode(config=args.config, layers=layers, experts=experts,
                                      tp=args.tp or (1 if args.target else jax.local_device_count()),
                                      batches=args.batch,
                                      contexts=args.context, dtype=args.dtype, steps=args.steps,
                                      strategies=strategies, hlo_dir=args.hlo_dir, progress=progress,
                                      copy_bytes=args.copy_mb << 20, target=args.target)
        except (ValueError, OSError, KernelUnavailableError, TargetUnavailable) as e:
            return fail(cmd, e)
        if jax.process_index() != 0:
            return 0
        print(bd.census_report(result))
        if args.json_path and write_json(bd.write_json, result, args.json_path, cmd):
            return 2
        return 0
    try:
        result = bd.bench_decode(config=args.config, layers=layers, experts=experts,
                                 tp=args.tp or jax.local_device_count(), batches=args.batch, contexts=args.context,
                                 dtype=args.dtype, steps=args.steps, repeats=args.repeats,
                                 copy_bytes=args.copy_mb << 20, strategies=strategies, hlo_dir=args.hlo_dir,
                                 progress=progress)
    except (ValueError, OSError, KernelUnavailableError) as e:  # --kernels on where none runs; --config / --layers / --tp / --batch, an unreadable --config
        return fail(cmd, e)
    if jax.process_index() != 0:  # every process measured its own ranks; process 0 reports
        return 0
    return report(args, cmd, bd.decode_table(result), result, bd.write_json, bd.plot)


def report(args, cmd: str, table: str, result: dict, write, plot) -> int:
    """Prints a bench's table, then writes --json and --plot where asked (one-line errors, exit 2)."""
    print(table)
    if args.json_path and write_json(write, result, args.json_path, cmd):
        return 2
    if args.plot:
        try:
            plot(result, args.plot)
            print(f"wrote {args.plot}")
        except ImportError as e:
            print(f"jaxk3: --plot needs matplotlib ({one_line(e)}); the table and JSON are complete", file=sys.stderr)
        except OSError as e:
            return fail(cmd, f"--plot {args.plot}: cannot write ({e.strerror or e})")
    return 0


def kernels(args) -> int:
    from jaxk3.tools import bench_kernels

    try:
        res = bench_kernels.bench_kernels(args.config, tp=args.tp, experts=args.experts, batches=args.batch,
                                          chain=args.chain, repeats=args.repeats)
    except ValueError as e:
        return fail("jaxk3 bench kernels", e)
    print(bench_kernels.format_rows(res))
    if args.json_path:
        return write_json(_dump_json, res, args.json_path, "jaxk3 bench kernels")
    return 0


def _dump_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def run(args) -> int:
    if args.bench_cmd == "gather":
        return gather(args)
    if args.bench_cmd == "decode":
        return decode(args)
    if args.bench_cmd == "kernels":
        return kernels(args)
    return generate(args)


def generate(args) -> int:
    """`jaxk3 bench generate`: refused up front (exit 2) when the run cannot fit this machine."""
    import jax

    from jaxk3.tools import bench_generate as bg

    cmd = "jaxk3 bench generate"
    for opt, v in (("--prefill-chunk", args.prefill_chunk), ("--baseline-chunk", args.baseline_chunk)):
        if v is not None and v % 64:
            return fail(cmd, f"{opt} {v}: must be a multiple of 64")
    if args.tp > len(jax.devices()):
        return fail(cmd, f"--tp {args.tp}: only {len(jax.devices())} devices present")
    shape = dict(config=args.config, tp=args.tp, batches=tuple(args.batch), prompt=args.prompt, new=args.new,
                 experts=args.experts, dtype=args.dtype)
    try:
        problem = bg.memory_problem(**shape, prefill_chunk=args.prefill_chunk, decode_chunk=args.decode_chunk)
        if problem is not None:
            return fail(cmd, problem)
        res = bg.run(**shape, gather="auto", psum=args.psum, prefill_chunk=args.prefill_chunk,
                     decode_chunk=args.decode_chunk, progress=progress, baseline_chunk=args.baseline_chunk,
                     copy_bytes=args.copy_mb << 20, breakdown=args.breakdown)
    except ValueError as e:  # --config contents, --tp not dividing, --experts below top-k, ...
        return fail(cmd, e)
    return report(args, cmd, bg.table(res), res, _dump_json, bg.plot)
