"""The kernel registry and its kernels against their jnp reference paths.

Each device kernel runs here in Pallas interpret mode (the CPU), on random inputs (never zeros;
outputs are fresh arrays, so nothing unwritten survives), bf16 and fp32, ragged batch sizes.
Tolerance: the kernel computes the same fp32 expression as the reference; interpret mode and XLA
may fuse the mean differently, so 1e-6 relative (fp32 rounding of a 256-term sum) — a wrong
kernel (missing eps, wrong axis, no weight) is off by >= 1e-3.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxk3 import kernels


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_rms_norm_kernel_matches_reference(dtype, B):
    rng = np.random.default_rng(B)
    x = jnp.asarray(rng.standard_normal((B, 256)) * 3, dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(256), dtype)
    k = kernels.REGISTRY["rms_norm"]
    got = np.asarray(k.device(x, w, 1e-5, interpret=True))
    ref = np.asarray(k.reference(x, w, 1e-5))
    assert got.dtype == ref.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.max(np.abs(ref)))


def test_selection_and_switch():
    x, w = jnp.ones((2, 256)), jnp.ones(256)
    assert kernels.explain("rms_norm", x, w, 1e-5, platform="gpu").startswith("device")
    assert "kernels='off'" in kernels.explain("rms_norm", x, w, 1e-5, platform="gpu", mode="off")
    assert "platform 'cpu'" in kernels.explain("rms_norm", x, w, 1e-5, platform="cpu")
    assert "power of two" in kernels.explain("rms_norm", jnp.ones((2, 2304)), jnp.ones(2304), 1e-5, platform="gpu")
    # on this CPU machine auto takes the reference, and "on" names why it cannot
    np.testing.assert_array_equal(np.asarray(kernels.call("rms_norm", x, w, 1e-5)),
                                  np.asarray(kernels.REGISTRY["rms_norm"].reference(x, w, 1e-5)))
    with pytest.raises(kernels.KernelUnavailableError, match="platform 'cpu'"):
        kernels.call("rms_norm", x, w, 1e-5, mode="on")
    with pytest.raises(ValueError, match="mode must be one of"):
        kernels.explain("rms_norm", x, w, 1e-5, mode="fast")
    assert kernels.active("gpu")["rms_norm"] and not kernels.active("cpu")["rms_norm"]
    with pytest.raises(ValueError, match="registered twice"):
        kernels.register(kernels.REGISTRY["rms_norm"])
    assert jax.devices()[0].platform == "cpu"


@pytest.mark.gpu
def test_rms_norm_kernel_on_gpu():
    """The compiled Pallas kernel (Triton) on a GPU against the reference, at a K3-like width."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() != "cpu" else []
    if not gpus:
        pytest.skip("needs a CUDA GPU (JAX_PLATFORMS=cuda)")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 4096)), jnp.bfloat16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(4096), jnp.bfloat16)
    assert kernels.explain("rms_norm", x, w, 1e-5).startswith("device")
    got = np.asarray(jax.jit(lambda x, w: kernels.call("rms_norm", x, w, 1e-5, mode="on"))(x, w))
    ref = np.asarray(kernels.REGISTRY["rms_norm"].reference(x, w, 1e-5))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))
