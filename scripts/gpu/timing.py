"""The timing both GPU scripts share: the median over `reps` of (wall time of `inner` back-to-back
calls of a compiled chain) / (inner * chain), after one warm-up call."""
from __future__ import annotations

import statistics
import time

import jax


def per_call(c, args, *, reps: int, inner: int, chain: int) -> float:
    jax.block_until_ready(c(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = c(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / (inner * chain))
    return statistics.median(ts)


def logger(json_path: str):
    """`log(line)`: prints a line and appends it to the run's .log beside its JSON."""
    logf = open(json_path.replace(".json", ".log"), "w")

    def log(s: str) -> None:
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()
    return log
