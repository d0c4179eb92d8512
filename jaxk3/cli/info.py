"""`jaxk3 info`: versions, the FFI handlers built, devices, the collectives' defaults and what
kernels='auto' runs; with --checkpoint / --config, the memory report (jaxk3.tools.memory)."""
from __future__ import annotations

import json
import sys

from jaxk3.cli.common import config_problem, cpu_devices_arg, fail, positive


# Forms of the decode step behind a module switch, each taken by default where a same-call A/B on a GPU timed it faster
# (docs/PERF.md, twenty-ninth session), the switch kept for the next A/B (`scripts/gpu/step_with_kernel.py
# MODULE:SWITCH=0`): (module, switch, what it does).  `info` prints each switch's value.
FORM_SWITCHES = (
    ("jaxk3.kernels.attn_res_norm", "SELECT_STACK",
     "the AttnRes stack by selects, the mix as a sum (K3 decode, up to 8 rows)"),
    ("jaxk3.layers.moe", "LATENT_NORM_IN_UP", "the latent norm in the up projection's GEMV prologue (K3 decode, one row)"),
    ("jaxk3.kernels.mla_decode", "MERGE_R",
     "the MLA attention's parts merged by latent columns (mla_decode_uv, from MERGE_R_MIN_PARTS parts: long contexts)"),
)


def form_switches() -> dict[str, bool]:
    """{module.switch: its value} of FORM_SWITCHES."""
    import importlib

    return {f"{m}.{a}": bool(getattr(importlib.import_module(m), a)) for m, a, _ in FORM_SWITCHES}


def add_parser(sub) -> None:
    info = sub.add_parser("info", help="versions, FFI handlers built, devices, gather default")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    mem = info.add_argument_group(
        "memory report (jaxk3/memory.py; docs/CHECKPOINTS.md \"Memory\")",
        "With --checkpoint or --config: HBM bytes per TP rank by part, the cache, and the fewest H200s per "
        "TP x DP layout for MXFP4 and dense experts. Reads only config.json and safetensors headers; no device is used.")
    mem.add_argument("--checkpoint", metavar="DIR", default=None, help="checkpoint directory (config.json + headers only)")
    mem.add_argument("--config", metavar="k3|kimi-linear-48b|tiny|PATH", default=None,
                     help="a preset or a HF config.json / model dir, instead of --checkpoint")
    mem.add_argument("--tp", type=positive, default=8, help="TP size of the per-rank breakdown (default 8)")
    mem.add_argument("--experts", choices=("auto", "mxfp4", "dense"), default="auto",
                     help="routed experts held as MXFP4 or dense (auto: as the checkpoint / config has them)")
    mem.add_argument("--batch", type=positive, default=1, help="rows decoded at once, split over DP (default 1)")
    mem.add_argument("--context", type=positive, default=8192, help="positions per row the cache holds (default 8192)")
    cpu_devices_arg(info)


def check_args(args) -> str | None:
    """What `jaxk3 info` can see in its arguments alone (cli.check_args calls this)."""
    if args.checkpoint is not None and args.config is not None:
        return "--checkpoint and --config: give one of them"
    if args.config is not None:
        return config_problem(args.config)
    return None


def run(args) -> int:
    if args.checkpoint is not None or args.config is not None:  # the memory report: no device is started
        from jaxk3.tools import memory
        try:
            d = memory.cli_info(checkpoint=args.checkpoint, config=args.config, tp=args.tp, experts=args.experts,
                                batch=args.batch, context=args.context)
        except (ValueError, OSError) as e:  # CheckpointError is a ValueError
            return fail("jaxk3 info", e)
        print(json.dumps(d, indent=1) if args.json else memory.format_report(d))
        return 0
    import jax
    import jaxlib

    from jaxk3 import __version__, collectives, kernels

    try:
        ext = collectives.extension()
    except ValueError as e:  # a bad JAXK3_* setting, named by the settings module
        return fail("jaxk3 info", e)
    built = ext.build_info() if ext is not None else {}
    devices = jax.devices()
    info = {
        "jaxk3": __version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": sys.version.split()[0],
        "ffi_extension": ext is not None,
        "ffi_extension_error": collectives.extension_error(),
        "ffi_cpu": bool(built.get("ffi_cpu", False)),
        "ffi_cuda": bool(built.get("ffi_cuda", False)),
        "cuda_archs": [a for a in str(built.get("cuda_archs", "")).split(",") if a],
        "built_with_jax": built.get("built_with_jax"),
        "platform": devices[0].platform,
        "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devices],
        "process_index": jax.process_index(),
        "gather_default": collectives.default_impl(),
        "gather_default_variable": collectives.ENV_IMPL,
        "gather_timeout_s": (ext.timeout_ms() / 1000) if ext is not None else None,
        "gather_max_rows": collectives.max_rows(),
        "gather_max_bytes": collectives.max_bytes(devices[0].platform if devices[0].platform == "cpu" else "CUDA"),
        "kernels_auto": kernels.status(devices[0].platform),
        "kernels_measured": kernels.speeds(),
        "form_switches": form_switches(),
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"jaxk3 {info['jaxk3']}  (jax {info['jax']}, jaxlib {info['jaxlib']}, python {info['python']})")
    if ext is None:
        print(f"FFI extension: NOT available: {info['ffi_extension_error']}")
    else:
        archs = ",".join(info["cuda_archs"]) or "-"
        print(f"FFI handlers: cpu={'yes' if info['ffi_cpu'] else 'no'}  cuda={'yes' if info['ffi_cuda'] else 'no'}"
              f" (archs {archs})  built against jaxlib {info['built_with_jax']}")
    print(f"devices ({len(devices)}): " + ", ".join(info["devices"]))
    print(f"gather default: {info['gather_default']}  (set {collectives.ENV_IMPL}=auto|ffi|lax to change)"
          f"; timeout {info['gather_timeout_s']} s ({collectives.ENV_TIMEOUT})"
          f"; FFI path up to {info['gather_max_rows']} rows and {info['gather_max_bytes']} bytes per rank")
    print("device kernels with kernels='auto' (shapes permitting):")
    for name, how in info["kernels_auto"].items():
        print(f"  {name:<14} {how}")
        print(f"  {'':<14} measured: {info['kernels_measured'][name]}")
    print("decode forms behind switches (on where a GPU A/B timed them faster; docs/PERF.md):")
    for (m, a, what), on in zip(FORM_SWITCHES, info["form_switches"].values()):
        print(f"  {m.rsplit('.', 1)[-1]}.{a}={'on' if on else 'off'}: {what}")
    return 0
