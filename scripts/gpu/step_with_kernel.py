"""`jaxk3 bench decode` with named kernels taken by `kernels="auto"` at every shape they fit, proven or not
(the registry entry patched in this process only): what a kernel does to the whole step before its speed
gate is filled in; or, with `-NAME`, the step with that kernel left out (auto keeps XLA's path), what a
proven kernel adds.  Compare with the same bench without the patch (or the checkpoint/off variant in the
same run); a kernel is proven only by its compiled tests and its timing against XLA (docs/ARCHITECTURE.md).

    python scripts/gpu/step_with_kernel.py moe_experts -- --config kimi-linear-48b --layers all --experts 64 ...
    python scripts/gpu/step_with_kernel.py -moe_experts -- ...
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())

from jaxk3 import kernels  # noqa: E402
from jaxk3.kernels import registry  # noqa: E402
from jaxk3.cli import main as cli_main  # noqa: E402


def patch(name: str) -> None:
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
    sys.exit(cli_main(["bench", "decode", *argv[cut + 1:]]))
