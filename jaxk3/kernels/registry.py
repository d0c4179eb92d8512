"""The kernel registry: `Kernel`, `register`, and the selection (`call`, `explain`, `status`,
`active`), plus the two helpers every kernel module's wrapper shares (`pow2`, `triton_params`).
Imports nothing from jaxk3: kernel modules register here, and jaxk3.kernels re-exports it."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import jax

from jaxk3 import _compat

MODES = ("auto", "off", "on")


class KernelUnavailableError(RuntimeError):
    """mode="on" was asked for but the device kernel does not apply; the message says why."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    reference: Callable[..., Any]  # jnp: the CPU path and the test oracle
    device: Callable[..., Any]  # the device kernel; device(*args, interpret=True) runs it on the CPU (tests)
    platforms: tuple[str, ...]  # jax platform names the device kernel compiles for ("gpu", ...)
    fits: Callable[..., str | None] = lambda *a, **k: None
    # Why `auto` must not select the device path yet (None: it may).  A kernel tested only in
    # interpret mode says so here until its compiled test has passed on the device.
    unproven: str | None = None
    # Its speed against the XLA path it replaces at the presets' real dims, as measured (docs/PERF.md).
    measured: str = "not measured"


REGISTRY: dict[str, Kernel] = {}


def pow2(n: int) -> bool:
    """Whether n is a power of two (Triton's block sizes must be)."""
    return n > 0 and not n & (n - 1)


def dot_nt(a, b):
    """a [M, K] @ b [N, K].T -> [M, N], float32 accumulation (bf16 operands: tensor cores), inside a kernel."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jax.numpy.float32)


def triton_params(num_warps: int, num_stages: int, interpret: bool) -> dict:
    """pallas_call's compiler_params for the Triton lowering ({} in interpret mode, which takes none)."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as plgpu

    return dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))


def register(kernel: Kernel) -> Kernel:
    if kernel.name in REGISTRY:
        raise ValueError(f"kernel {kernel.name!r} is registered twice")
    REGISTRY[kernel.name] = kernel
    return kernel


def _platform() -> str:
    return _compat.device_platform()


def explain(name: str, *args, mode: str = "auto", platform: str | None = None, **kwargs) -> str:
    """'device: ...' or 'reference: <reason>' for a call of kernel `name` with these arguments."""
    if mode not in MODES:
        raise ValueError(f"kernels: mode must be one of {MODES}, got {mode!r}")
    k = REGISTRY[name]
    platform = platform or _platform()
    if mode == "off":
        return "reference: kernels='off'"
    kwargs = _on_runs_anywhere(k, mode, kwargs)
    if platform not in k.platforms:
        return f"reference: no {name} kernel for platform {platform!r} (has {k.platforms})"
    why = k.fits(*args, **kwargs)
    if why:
        return f"reference: {why}"
    if k.unproven and mode == "auto":
        return f"reference: {name} is unproven on {platform} ({k.unproven}); kernels='on' runs it"
    return f"device: {name} on {platform}"


def _on_runs_anywhere(k: Kernel, mode: str, kwargs: dict) -> dict:
    """mode "on" runs a speed-gated kernel (its `fits` takes `only_where_faster`: auto takes it only at
    the shapes where it beat XLA) at every shape it fits, unless the caller said otherwise."""
    if mode == "on" and "only_where_faster" in inspect.signature(k.fits).parameters:
        return {"only_where_faster": False, **kwargs}
    return kwargs


def call(name: str, *args, mode: str = "auto", **kwargs):
    """Run kernel `name` through the path `explain` chooses (statically, at trace time)."""
    how = explain(name, *args, mode=mode, **kwargs)
    k = REGISTRY[name]
    kwargs = _on_runs_anywhere(k, mode, kwargs)
    if how.startswith("device"):
        return k.device(*args, **kwargs)
    if mode == "on":
        raise KernelUnavailableError(f"kernels='on' but {name} does not apply: {how[len('reference: '):]}")
    return k.reference(*args, **kwargs)


def status(platform: str | None = None) -> dict[str, str]:
    """Per registered kernel, what `kernels="auto"` does with it on `platform`: "device" or
    "reference: <why>" (no kernel for the platform, or not yet proven there).  Shapes aside."""
    platform = platform or _platform()
    out = {}
    for n, k in sorted(REGISTRY.items()):
        if platform not in k.platforms:
            out[n] = f"reference: no {n} kernel for platform {platform!r}"
        elif k.unproven:
            out[n] = f"reference: unproven on {platform} ({k.unproven})"
        else:
            out[n] = "device"
    return out


def speeds() -> dict[str, str]:
    """Per registered kernel, its measured speed against its XLA path (`Kernel.measured`)."""
    return {n: k.measured for n, k in sorted(REGISTRY.items())}


def active(platform: str | None = None) -> dict[str, bool]:
    """Per registered kernel: whether `auto` can select its device path on `platform`."""
    platform = platform or _platform()
    return {n: platform in k.platforms and not k.unproven for n, k in sorted(REGISTRY.items())}

