"""One process of the 2-process CPU tests (tests/test_distributed.py); not a test module.

usage: python mp_worker.py COORD PROCESS_ID MODE OUT_JSON
MODE: dp (DP 2 x TP 4), tp8 (one TP group of 8 spanning both processes), die (DP 2 x TP 4 as dp, each
process writes its result of the first generate, then process 1 dies; process 0 generates again and
must fail, not hang).
"""
import json
import os
import sys

# the flags the test passes (conftest.CHILD_XLA_FLAGS), and this process's device count
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

coord, pid, mode, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

from jaxk3 import distributed  # noqa: E402

distributed.initialize(coord, num_processes=2, process_id=pid, heartbeat_timeout_s=10, initialization_timeout_s=60)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jaxk3  # noqa: E402
from jaxk3 import collectives  # noqa: E402

from small_models import tiny_k3_4l  # noqa: E402  (this file's folder is the script's sys.path[0])

PROMPTS = [[5, 9, 100, 7], [3, 1], [8, 8, 8], [42]]
cfg = tiny_k3_4l()
if mode == "tp8":
    mesh = Mesh(np.asarray(jax.devices()), ("tp",))
    model = jaxk3.init_random_model(cfg, seed=0, mesh=mesh, dtype="float32", gather="auto")
    plan = collectives.explain(jax.ShapeDtypeStruct((1, 16), np.float32), "tp", mesh=mesh)
else:
    mesh = distributed.make_mesh(tp=4)
    model = jaxk3.init_random_model(cfg, seed=0, mesh=mesh, gather="auto")
    plan = collectives.explain(jax.ShapeDtypeStruct((1, 16), np.float32), "tp", mesh=mesh)
tokens = model.generate(PROMPTS, 5).tokens
result = {"process": pid, "tokens": tokens.tolist(), "plan": str(plan), "path": plan.path}
if mode == "die":
    with open(out, "w") as fh:  # the first generate's result (test_dp2_tp4_matches_single_process reads it)
        json.dump(result, fh)
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("first generate done")  # both have their result before one dies
    if pid == 1:
        os._exit(17)  # dies mid-run, without saying goodbye
    model.generate(PROMPTS, 5)  # needs process 1: must fail, not hang
    result["second_generate"] = "returned"
with open(out, "w") as fh:
    json.dump(result, fh)
