"""Where `Model.score`'s host time goes (issue 23): a 4096-position row of Kimi-Linear-48B's fp32 logits
([1, 4096, 163840], 2.7 GB) on the device, then each step of getting it to the host timed alone:
np.asarray (the device-to-host copy into a fresh array), a fresh np.empty filled from it (the copy `score` makes to
place chunks), the same into an array already touched, and np.asarray after copy_to_host_async.

    python scripts/gpu/host_copy.py [--positions 4096] [--vocab 163840]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=163840)
    a = ap.parse_args()
    shape = (1, a.positions, a.vocab)
    gb = np.prod(shape) * 4 / 1e9
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32))

    def fresh(i):
        x = make(jax.random.key(i))
        x.block_until_ready()
        return x

    def timed(name, f):
        t0 = time.perf_counter()
        r = f()
        t = time.perf_counter() - t0
        print(f"{name:55s} {t:7.3f} s  {gb / t:6.2f} GB/s", flush=True)
        return r

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {shape} float32 = {gb:.2f} GB", flush=True)
    for rep in range(2):
        x = fresh(rep)
        host = timed(f"[{rep}] np.asarray (device to host)", lambda: np.asarray(x))
        out = timed(f"[{rep}] np.empty + copy (score's placing)", lambda: np.copyto(np.empty(shape, np.float32), host))
        dst = np.empty(shape, np.float32)
        dst.fill(0)
        timed(f"[{rep}] copy into a touched array", lambda: np.copyto(dst, host))
        y = fresh(rep + 10)
        timed(f"[{rep}] copy_to_host_async + np.asarray", lambda: (y.copy_to_host_async(), np.asarray(y))[1])
        print(f"[{rep}] np.asarray writeable: {host.flags.writeable}, owns data: {host.flags.owndata}", flush=True)
        del x, y, host, out, dst


if __name__ == "__main__":
    main()
