"""`jaxk3 demo`: the embedded default job (a tiny random K3 model on CPU devices, the one-shot
collectives against lax, and the gather verdict)."""
from __future__ import annotations

from jaxk3.cli.common import cpu_devices_arg


def add_parser(sub) -> None:
    demo = sub.add_parser("demo", help="the embedded default job (no files needed)")
    cpu_devices_arg(demo, default=None)
    demo.add_argument("--gather-only", action="store_true", help="only the gather benchmark verdict")


def run(args) -> int:
    import jax

    from jaxk3.tools import bench_gather as bench

    devices = jax.devices()
    print(f"jaxk3 demo on {len(devices)} x {devices[0].device_kind} ({devices[0].platform})", flush=True)
    status = 0
    try:
        from jaxk3.tools import demo as model_demo
    except ImportError:
        model_demo = None
    if model_demo is not None and not args.gather_only:
        from jaxk3.config import KimiK3Config

        tp, why = model_demo.pick_tp(KimiK3Config.tiny_k3(), len(devices))
        if why is not None:
            print(f"model: TP {tp} on {tp} of the {len(devices)} devices (the largest TP that divides the tiny "
                  f"model: {why})", flush=True)
        res = model_demo.run_demo(tp=tp)
        if not res["tokens_equal"]:
            print("FAIL: the one-shot-collectives model and the lax model chose different tokens")
            status = 1
        else:
            print(f"model: {res['new_tokens']} tokens identical with every collective one-shot and with every one "
                  f"lax; decode {res['fast_median_ms']:.2f} ms/token (one-shot) vs {res['lax_median_ms']:.2f} ms/token "
                  f"(lax): {res['speedup']:.2f}x (target >= 1.15x)")
    sizes = (64, 1024, 4096)
    result = bench.bench_gather(sizes=sizes, chain=100, repeats=7, devices=devices)
    print(bench.gather_table(result))
    rows = {(r["bytes_per_rank"], r["impl"]): r["us_per_gather"] for r in result["rows"]}
    worst = min(rows[(s, "lax")] / rows[(s, "ffi")] for s in sizes)
    verdict = "PASS" if worst >= 2.0 else "BELOW TARGET"
    print(f"verdict: one-shot FFI gather is {worst:.1f}x faster than lax.all_gather at <= 4 KB per rank "
          f"on {len(devices)} devices (target >= 2x): {verdict}")
    return status
