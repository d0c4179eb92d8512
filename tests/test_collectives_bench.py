"""bench_collectives end to end on fake CPU devices: every op in every form, each with its two
floors, lax and the FFI path; the chains' built-in agreement checks hold; the table has a
section per op and form.  (Timings on a shared CPU mean nothing here.)  `--load`: the busy
processes run beside the chains, are reported, and are gone afterwards."""
import json
import os
import time

import jax
import jax.numpy as jnp
import pytest

from jaxk3 import cli
from jaxk3.tools import bench_gather as bench


def test_every_op_and_form_in_one_run():
    res = bench.bench_collectives(sizes=(64, 1024), chain=4, repeats=1, devices=jax.devices()[:4],
                                  dtype=jnp.bfloat16)
    got = {(r["op"], r["form"], r["bytes_per_rank"], r["impl"]) for r in res["rows"]}
    assert got == {(o, f, b, i) for o in bench.OPS for f in bench.FORMS for b in (64, 1024) for i in bench.IMPLS}
    paths = {(r["op"], r["impl"]): r["path"] for r in res["rows"]}
    assert paths[("allreduce", "ffi")] == "ffi:all_reduce" and paths[("gather", "ffi")] == "ffi:one_shot"
    assert paths[("allreduce", "lax")] == "lax" and paths[("gather", "ffi_floor")] == "local"
    table = bench.gather_table(res)
    assert all(f"{o}, {f}" in table for o in bench.OPS for f in bench.FORMS)
    json.loads(json.dumps(res))


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, killed but not reaped, counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_bench_gather_load_runs_and_reports_it(tmp_path, capsys):
    """`jaxk3 bench gather --load 1`: the chains run beside one busy process, the table and the JSON
    say so, and the busy process is gone when the command returns."""
    out = tmp_path / "g.json"
    rc = cli.main(["bench", "gather", "--sizes", "64", "--chain", "2", "--repeats", "1", "--ops", "gather",
                   "--forms", "scan", "--load", "1", "--json", str(out)])
    assert rc == 0
    assert "load 1 busy processes" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["load"] == 1 and len(res["load_pids"]) == 1
    assert {r["impl"] for r in res["rows"]} == set(bench.IMPLS)
    assert not any(_alive(p) for p in res["load_pids"])


def test_busy_load_spins_and_is_gone_after_an_error():
    """The busy processes run (children of this process, on the CPU) while the block runs, and are
    killed and reaped when it raises, as on Ctrl-C."""
    with pytest.raises(KeyboardInterrupt):
        with bench.busy_load(2) as pids:
            assert len(pids) == 2 and all(_alive(p) for p in pids)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # each uses CPU time (utime, field 14 of /proc/pid/stat)
                stats = [open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split() for p in pids]
                if all(int(st[1]) == os.getpid() and int(st[11]) > 0 for st in stats):
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"busy processes not spinning: {stats}")
            raise KeyboardInterrupt
    assert not any(_alive(p) for p in pids)
