"""`jaxk3 bench decode` (or `generate`) with named kernels taken by `kernels="auto"` at every shape they fit, proven or not
(the registry entry patched in this process only): what a kernel does to the whole step before its speed
gate is filled in; or, with `-NAME`, the step with that kernel left out (auto keeps XLA's path), what a
proven kernel adds.  Compare with the same bench without the patch (or the checkpoint/off variant in the
same run); a kernel is proven only by its compiled tests and its timing against XLA (docs/ARCHITECTURE.md).

    python scripts/gpu/step_with_kernel.py moe_experts -- --config kimi-linear-48b --layers all --experts 64 ...
    python scripts/gpu/step_with_kernel.py -moe_experts -- ...

After `--`, `generate ...` runs `jaxk3 bench generate` instead (the decode loop's tokens/s with the patch; `decode`
or nothing: `bench decode`).

    python scripts/gpu/step_with_kernel.py moe_experts_routed -- generate --config kimi-linear-48b --batch 1

An argument MODULE:CLASS.FIELD=VALUE (e.g. `moe_experts:Config.bn=8`, a module of jaxk3.kernels) sets the default of
a kernel's config dataclass in this process: the step with another tiling than the one its sweep chose;
MODULE:NAME=VALUE sets a module constant the kernel reads at each call (`mla_decode:MERGE_STAGES=2`); a MODULE
spelled from `jaxk3.` is that module (`jaxk3.model:EXCESS_PRECISION=1`: the step as XLA's default precision compiles
it).
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())

from jaxk3 import kernels  # noqa: E402
from jaxk3.kernels import registry  # noqa: E402
from jaxk3.cli import main as cli_main  # noqa: E402


def set_default(arg: str) -> None:
    """MODULE:CLASS.FIELD=VALUE: calls of the kernel module's CLASS() take VALUE (an int, else the string);
    MODULE:NAME=VALUE: the module's constant NAME is VALUE (e.g. `mla_decode:ORDER=pg`, read at each call)."""
    import functools
    import importlib

    where, value = arg.split("=", 1)
    mod_name, attr = where.split(":")
    mod = importlib.import_module(mod_name if mod_name.startswith("jaxk3.") else f"jaxk3.kernels.{mod_name}")
    v = int(value) if value.lstrip("-").isdigit() else value
    if "." not in attr:
        if not hasattr(mod, attr):
            raise SystemExit(f"{mod.__name__} has no constant {attr}")
        setattr(mod, attr, v)
        print(f"patched: {mod_name}.{attr} = {v!r} (this process only)", flush=True)
        return
    cls_name, field = attr.split(".")
    setattr(mod, cls_name, functools.partial(getattr(mod, cls_name), **{field: v}))
    print(f"patched: {mod_name}.{cls_name}() takes {field}={v!r} (this process only)", flush=True)


def patch(name: str) -> None:
    if ":" in name:
        set_default(name)
        return
    if name.startswith("-"):
        name = name[1:]
        kernels.REGISTRY[name] = dataclasses.replace(kernels.REGISTRY[name], unproven="left out by step_with_kernel.py")
        print(f"patched: {name} left out (auto keeps XLA's path; this process only)", flush=True)
        return
    k = kernels.REGISTRY[name]

    def anywhere(*a, **kw):  # as kernels="on" calls a speed-gated kernel's fits (the registry's own rule)
        return k.fits(*a, **registry._on_runs_anywhere(k, "on", kw))
    kernels.REGISTRY[name] = dataclasses.replace(k, unproven=None, fits=anywhere)
    print(f"patched: {name} taken by auto wherever it fits (this process only)", flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    cut = argv.index("--")
    for n in argv[:cut]:
        patch(n)
    rest = argv[cut + 1:]
    bench = rest.pop(0) if rest and rest[0] in ("decode", "generate") else "decode"
    sys.exit(cli_main(["bench", bench, *rest]))
