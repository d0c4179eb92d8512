"""Two local processes on jax.distributed (CPU, gloo, 4 fake devices each).

DP 2 x TP 4 (TP inside a process: one-shot gathers) must give exactly the tokens of the same
mesh in one process; a TP group of 8 spanning both processes falls back to lax (gloo) and must
give the tokens of TP 8 in one process (float32, so the different reduction order of gloo
cannot flip a token); a process that dies makes the other fail in bounded time.

The model is the tiny K3's first four layers (tests/small_models.py, every kind of layer): what is
tested here is the processes' split of the work, and each process compiles the model.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxk3
from jaxk3.checkpoint import save_checkpoint
from jaxk3.model import random_hf_weights
from small_models import tiny_k3_4l
from conftest import CHILD_XLA_FLAGS  # noqa: E402

WORKER = Path(__file__).with_name("mp_worker.py")
PROMPTS = [[5, 9, 100, 7], [3, 1], [8, 8, 8], [42]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(mode: str, tmp_path: Path, timeout: float = 240):
    coord = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = CHILD_XLA_FLAGS  # the tests' XLA level (conftest.py); the child sets its devices
    env["JAXK3_GATHER_TIMEOUT_S"] = "20"
    procs, outs = [], []
    for pid in range(2):
        out = tmp_path / f"{mode}{pid}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), coord, str(pid), mode, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    t0 = time.monotonic()
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1, timeout - (time.monotonic() - t0)))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{mode}: a process hung for {timeout} s")
    results = [json.loads(o.read_text()) if o.exists() else None for o in outs]
    return procs, logs, results, time.monotonic() - t0


def dp_mesh() -> Mesh:
    """The (dp 2, tp 4) mesh of the two processes, in this one process."""
    return Mesh(np.asarray(jax.devices()).reshape(2, 4), ("dp", "tp"))


@pytest.fixture(scope="module")
def died(tmp_path_factory):
    """One two-process run for two tests (each pair compiles the model in both processes: about a minute
    on the 2-core CI machine): DP 2 x TP 4, both processes write the first generate's result, then
    process 1 dies and process 0 generates again (mp_worker.py, mode "die")."""
    return run_pair("die", tmp_path_factory.mktemp("die"), timeout=240)


def test_dp2_tp4_matches_single_process(died):
    procs, logs, results, _ = died
    for r, log in zip(results, logs):
        assert r is not None, log[-3000:]  # each process's first generate returned and wrote its result
    ref = jaxk3.init_random_model(tiny_k3_4l(), seed=0, mesh=dp_mesh(), gather="auto")
    want = ref.generate(PROMPTS, 5).tokens.tolist()
    for r in results:
        assert r["path"] == "ffi", r["plan"]  # TP inside a process: the one-shot path
        assert r["tokens"] == want


@pytest.mark.slow
def test_tp8_spanning_processes_falls_back_and_matches(tmp_path):
    procs, logs, results, _ = run_pair("tp8", tmp_path)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    cfg = tiny_k3_4l()
    want = jaxk3.init_random_model(cfg, seed=0, tp=8, dtype="float32", gather="auto").generate(PROMPTS, 5).tokens
    for r in results:
        assert r["path"] == "lax" and "spans processes" in r["plan"]
        assert r["tokens"] == want.tolist()


def test_dead_process_fails_the_other_in_bounded_time(died):
    procs, logs, results, elapsed = died
    assert procs[1].returncode == 17
    assert procs[0].returncode != 0, logs[0][-3000:]
    assert "second_generate" not in results[0]
    assert elapsed < 200
    assert any(w in logs[0].lower() for w in ("heartbeat", "unavailable", "failed", "error")), logs[0][-3000:]


@pytest.mark.slow
def test_generate_cli_two_processes_matches_one(tmp_path):
    """`jaxk3 generate` with --coordinator/--num-processes/--process-id: a batch of 3 prompts split
    over dp=2 (TP 4 inside each process) prints the tokens of the same checkpoint on the same mesh in
    one process.  (The batch is padded to 4 rows and the prompts and token count are those of the
    tests above, so the programs are theirs: the compilation cache serves them.)"""
    cfg = tiny_k3_4l()
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, cfg, random_hf_weights(cfg, seed=3), k3_layout=True, num_shards=2)
    prompts = "5,9,100,7;3,1;42"
    ref = jaxk3.load_model(str(ckpt), mesh=dp_mesh()).generate([[5, 9, 100, 7], [3, 1], [42]], 5).tokens
    coord = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = CHILD_XLA_FLAGS  # the tests' XLA level (conftest.py); the child sets its devices
    cmd = [sys.executable, "-m", "jaxk3.cli", "generate", "--checkpoint", str(ckpt), "--prompt-ids", prompts,
           "--max-new-tokens", "5", "--tp", "4", "--cpu-devices", "4", "--no-progress", "--coordinator", coord,
           "--num-processes", "2", "--heartbeat-timeout", "10"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("jaxk3 generate hung in a 2-process run")
        assert p.returncode == 0, err[-3000:]
        assert "dp=2" in err
        outs.append([[int(t) for t in line.split(": ")[1].split(",")] for line in out.splitlines()
                     if line.startswith("new ids: ")])
    assert outs[0] == outs[1] == ref.tolist()


@pytest.mark.slow
def test_bench_decode_two_processes(tmp_path):
    """`jaxk3 bench decode` on jax.distributed: mesh (dp=2, tp=4), batch split over dp; process 0
    writes the JSON, and the three strategies choose the same greedy tokens.  Layer 3: MLA and MoE, so
    every gather site the strategies differ in (the MLA latent, the MoE's latent z, the logits) and the
    psums (every strategy compiles its step in both processes: layers 3-4, with a KDA layer's psums
    beside them, took 52 s for the pair alone, this 36 s; the KDA layers' psums across the processes'
    split are in the tests above, the whole model's)."""
    coord = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = CHILD_XLA_FLAGS  # the tests' XLA level (conftest.py); the child sets its devices
    out = tmp_path / "decode.json"
    cmd = [sys.executable, "-m", "jaxk3.cli", "bench", "decode", "--config", "tiny", "--layers", "3", "--tp", "4",
           "--batch", "2", "--context", "64", "--steps", "2", "--repeats", "1", "--copy-mb", "1",
           "--cpu-devices", "4", "--json", str(out), "--coordinator", coord, "--num-processes", "2",
           "--heartbeat-timeout", "10"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for p in procs:
        try:
            log = p.communicate(timeout=300)[0]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("jaxk3 bench decode hung in a 2-process run")
        assert p.returncode == 0, log[-3000:]
    res = json.loads(out.read_text())
    assert {r["strategy"] for r in res["rows"]} == {"stock", "sharded+lax", "sharded+one-shot"}
    toks = [r["tokens"] for r in res["rows"]]
    assert all(t == toks[0] for t in toks) and len(toks[0][0]) == 2
