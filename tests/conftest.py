"""Test session set-up: 8 fake CPU devices, set before JAX initialises its backend."""
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests must not wait a minute for a peer that will never come.
os.environ.setdefault("JAXK3_GATHER_TIMEOUT_S", "20")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
