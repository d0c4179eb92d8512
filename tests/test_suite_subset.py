"""CI's newest-jax suite runs a subset (JAXK3_TEST_SUBSET=first-param, tests/conftest.py): each parametrized test's
first case outside the collectives' modules and test_golden.  What it must keep, read from pytest's own collection in
a child process (`--collect-only`, `-m 'not slow'` as CI passes it): every test function of the full set (the subset
drops cases, never a function), every case of the modules that run whole, and fewer cases in all.  Collected over
three modules, to keep it cheap: test_kernels (the most cases; a function there,
test_kda_prefill_kernel_matches_reference, has a `slow` first case, so the subset must be taken after `-m`'s
selection) and two that run whole."""
from __future__ import annotations

import collections
import os
import subprocess
import sys

from conftest import _EVERY_CASE as WHOLE  # the modules that run every case

HERE = os.path.dirname(os.path.abspath(__file__))


def _collect(subset: str | None, *paths: str) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAXK3_TEST_SUBSET", "JAXK3_TEST_LOG",
                                                            "PYTEST_XDIST_WORKER")}
    if subset is not None:
        env["JAXK3_TEST_SUBSET"] = subset
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "not slow", *(paths or (HERE,))], cwd=os.path.dirname(HERE), env=env,
                       capture_output=True, text=True, timeout=300)
    return r.returncode, [x for x in r.stdout.splitlines() if "::" in x] + [r.stderr]


def test_first_param_subset_keeps_every_function_and_the_whole_modules():
    files = [os.path.join(HERE, f) for f in ("test_kernels.py", "test_golden.py", "test_psum.py")]
    rc_all, every = _collect(None, *files)
    rc_sub, subset = _collect("first-param", *files)
    assert rc_all == 0 and rc_sub == 0, (every[-1][-2000:], subset[-1][-2000:])
    every, subset = every[:-1], subset[:-1]

    def functions(ids):
        return {i.split("[", 1)[0] for i in ids}

    assert set(subset) < set(every)  # a strict subset: cases dropped, none added
    assert functions(subset) == functions(every)
    whole = [i for i in every if os.path.basename(i.split("::", 1)[0]) in WHOLE]
    assert len(whole) > 50 and set(whole) <= set(subset)
    # outside those, one case a parametrized function
    per = collections.Counter(i.split("[", 1)[0] for i in subset
                              if "[" in i and os.path.basename(i.split("::", 1)[0]) not in WHOLE)
    assert per and max(per.values()) == 1, {k: n for k, n in per.items() if n > 1}


def test_an_unknown_subset_is_refused():
    rc, out = _collect("first", os.path.join(HERE, "test_config.py"))
    assert rc != 0 and "JAXK3_TEST_SUBSET='first': 'first-param' or 'all'" in out[-1], out[-1][-2000:]
