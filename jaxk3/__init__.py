"""jaxk3: Kimi-K3 / Kimi-Linear decode layers in JAX with one-shot FFI all-gathers."""

__version__ = "0.1.0"

from jaxk3 import collectives  # noqa: F401
