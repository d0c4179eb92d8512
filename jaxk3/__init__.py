"""jaxk3: Kimi-K3 / Kimi-Linear decode layers in JAX with one-shot FFI all-gathers."""

__version__ = "0.1.0"

from jaxk3 import collectives  # noqa: F401
from jaxk3.config import KimiK3Config  # noqa: F401,E402
from jaxk3.engine import Model, init_random_model, load_model  # noqa: F401,E402
