"""bench_collectives end to end on fake CPU devices: every op in every form, each with its two
floors, lax and the FFI path; the chains' built-in agreement checks hold; the table has a
section per op and form.  (Timings on a shared CPU mean nothing here.)"""
import json

import jax
import jax.numpy as jnp

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
