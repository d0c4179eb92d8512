"""Where `Model.score`'s host time goes (issue 23): a 4096-position row of Kimi-Linear-48B's fp32 logits
([1, 4096, 163840], 2.7 GB) on the device, then each step of getting it to the host timed alone:
np.asarray (the device-to-host copy into a fresh array), a fresh np.empty filled from it (the copy `score` makes to
place chunks), the same into an array already touched, and np.asarray after copy_to_host_async; then the forms a
faster `score` could take (pinned host memory, slices in flight, the destination touched by threads), and score's
own path (jaxk3.model.host_slices, jaxk3.engine._copy) by slice size and thread count.

    python scripts/gpu/host_copy.py [--positions 4096] [--vocab 163840] [--score-only]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--score-only", action="store_true", help="only score's own path (the last part)")
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
    for rep in range(0 if a.score_only else 2):
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
    # the forms a faster `score` could take: the device-to-host copy into pinned host memory (a DMA at PCIe speed),
    # then read from there; slices in flight at once; the destination's pages touched by threads
    dev = jax.devices()[0]
    try:
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    except Exception as e:  # noqa: BLE001
        print(f"pinned_host: not available ({e})", flush=True)
        pinned = None
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(16)

    def touched(n_threads: int):
        a = np.empty(shape, np.float32)
        flat = a.reshape(-1)
        step = -(-flat.size // n_threads)
        list(pool.map(lambda i: flat[i * step:(i + 1) * step].fill(0), range(n_threads)))
        return a

    for rep in range(0 if a.score_only else 2):
        timed(f"[{rep}] np.empty touched by 16 threads", lambda: touched(16))
        if pinned is not None:
            x = fresh(rep + 20)
            p = timed(f"[{rep}] device_put to pinned_host", lambda: jax.block_until_ready(jax.device_put(x, pinned)))
            h = timed(f"[{rep}] np.asarray of the pinned array", lambda: np.asarray(p))
            print(f"[{rep}] pinned np.asarray writeable: {h.flags.writeable}, owns data: {h.flags.owndata}", flush=True)
            dst = touched(16)
            timed(f"[{rep}] pinned -> touched array, 16 threads", lambda: list(pool.map(
                lambda i: np.copyto(dst[:, i * 256:(i + 1) * 256], h[:, i * 256:(i + 1) * 256]),
                range(-(-a.positions // 256)))))
            del x, p, h, dst
        x = fresh(rep + 30)
        n = 8
        parts = [x[:, i * (a.positions // n):(i + 1) * (a.positions // n)] for i in range(n)]
        jax.block_until_ready(parts)
        dst = touched(16)

        def sliced():
            for q in parts:
                q.copy_to_host_async()
            list(pool.map(lambda i: np.copyto(dst[:, i * (a.positions // n):(i + 1) * (a.positions // n)],
                                              np.asarray(parts[i])), range(n)))
        timed(f"[{rep}] {n} slices async + threads into a touched array", sliced)
        del x, parts, dst

    # score's own path (jaxk3.model.host_slices + jaxk3.engine._copy) into a fresh array, by slice size and threads
    from jaxk3 import engine, model
    for rep in range(2):
        for mb in (64, 256, 1024):
            for threads in (8, 16):
                x = fresh(rep + 40)

                out = np.empty(shape, np.float32)
                # score's first touch of its output (done while the device runs the prefill), then the slices
                timed(f"[{rep}] score's fill of a fresh output, {threads} threads",
                      lambda: engine._fill(pool, threads, out.reshape(-1, shape[-1]), np.nan))

                def placed():
                    for s0, s1, h in model.host_slices(x, axis=1, max_bytes=mb << 20):
                        engine._copy(pool, threads, out[0, s0:s1], h[0])
                    return out
                timed(f"[{rep}] score's path after the fill: {mb} MB slices, {threads} threads", placed)
                del x, out


if __name__ == "__main__":
    main()
