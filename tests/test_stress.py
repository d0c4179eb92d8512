"""Load that used to abort the process (issue 15): long prompts, several threads with several
models, on 8 CPU devices.  Every run must finish and equal the serial run; the test is bounded in
time by its sizes (tiny models, a few dispatches per call)."""
from __future__ import annotations

import threading

import numpy as np

import jaxk3
from jaxk3.config import KimiK3Config


def test_long_prompt_at_tp8_does_not_abort():
    """300 prompt tokens at TP 8 (the token-by-token path queued 300 steps and XLA aborted at ~200)."""
    m = jaxk3.init_random_model(KimiK3Config.tiny_k3(), seed=0, tp=8)
    out = m.generate([list(range(1, 301))], 4)
    assert out.tokens.shape == (1, 4) and out.prompt_tokens == 512


def test_threads_with_models_equal_serial_runs():
    """4 threads x 4 models (TP 8, 300-token prompts), each generating concurrently, equal the serial runs."""
    cfg = KimiK3Config.tiny_k3()
    models = [jaxk3.init_random_model(cfg, seed=s, tp=8) for s in range(4)]
    prompts = [list(np.random.default_rng(s).integers(0, 1000, 300)) for s in range(4)]
    serial = [m.generate([p], 4).tokens for m, p in zip(models, prompts)]
    got, errors = [None] * 4, []

    def work(i):
        try:
            got[i] = models[i].generate([prompts[i]], 4).tokens
        except Exception as e:  # reported below; a crash of the process would fail the run outright
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for a, b in zip(got, serial):
        np.testing.assert_array_equal(a, b)


def test_prefill_on_two_cpu_devices_finishes():
    """A 2-device process: the KDA prefill once used XLA's CPU triangular solve (a LAPACK custom
    call), which starved the 2-thread runtime and hung forever; `jaxk3 bench generate` runs the
    prefill and the decode loop end to end here, bounded by the subprocess timeout."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "jaxk3.cli", "bench", "generate", "--cpu-devices", "2", "--config", "tiny", "--tp",
           "2", "--batch", "1", "--prompt", "70", "--new", "4", "--prefill-chunk", "64", "--decode-chunk", "3"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TTFT s" in r.stdout and "decode tok/s" in r.stdout
