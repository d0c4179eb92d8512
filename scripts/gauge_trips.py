"""Whether the CPU transport's waiters go to sleep during the tiny model's decode (ffi/yield_gauge.h): `jaxk3 demo`'s
model run (tiny K3, TP 8 on 8 CPU devices, the collectives one-shot, then lax) in RUNS fresh processes, each watched
by a thread that polls `waiters_sleeping()` every 2 ms.  Prints, per process, the one-shot and lax ms a token and the
seconds at which the waiters went to sleep (none: they yielded throughout).  No busy process should run beside it:
the gauge is meant to put the waiters to sleep then.

    python scripts/gauge_trips.py [RUNS]      (docs/PERF.md, thirty-ninth session)
"""
from __future__ import annotations

import os
import subprocess
import sys

CHILD = r"""
import os, threading, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
from jaxk3 import _ffi as ext
from jaxk3.tools import demo
t0, trips, stop = time.time(), [], []
def watch():
    last = False
    while not stop:
        s = ext.waiters_sleeping()
        if s and not last:
            trips.append(round(time.time() - t0, 2))
        last = s
        time.sleep(0.002)
threading.Thread(target=watch, daemon=True).start()
r = demo.run_demo(tp=8, verbose=False)
stop.append(1)
print(f"one-shot {r['fast_median_ms']:.2f} ms/token, lax {r['lax_median_ms']:.2f}, waiters asleep at "
      f"{trips or 'no time'} s, {'asleep' if ext.waiters_sleeping() else 'yielding'} at the end")
"""


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    asleep = 0
    for i in range(runs):
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        line = (out.stdout.strip().splitlines() or [out.stderr.strip()[-300:]])[-1]
        asleep += "no time" not in line
        print(f"process {i}: {line}", flush=True)
    print(f"waiters went to sleep in {asleep} of {runs} processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
