"""pytest plugin for scripts/jax_dropin_tests.sh: runs JAX's own tests with jaxk3's collectives
installed in place of lax's, and counts the tests that take the FFI path.

Configured by environment variables (the script sets them):
- JAXK3_DROPIN_OPS: comma-separated ops, of ``all_gather`` and ``psum``; only the test cases
  whose function source mentions one of them (the substring: ``lax.all_gather(``, but also
  ``all_gather_invariant`` or ``psum_scatter``) are kept;
- JAXK3_DROPIN_PATTERN: a regular expression that replaces the mention test (optional);
- JAXK3_DROPIN_IMPL: ``ours`` (``jax.lax.<op> = jaxk3.collectives.<op>``) or ``lax`` (nothing
  replaced: the baseline);
- JAXK3_DROPIN_JSON: where to write the per-test outcomes and FFI counts (optional).

A test "takes the FFI path" when jaxk3 emitted at least one FFI custom call while it ran
(``jaxk3.collectives.lowering.emitted``, counted when a collective is lowered to the FFI
target); "bound" counts the tests in which a jaxk3 primitive was bound at all (the
trace-time decision was FFI; a roofline or a jaxpr check never lowers it).
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import re

import pytest

OPS = tuple(o for o in os.environ.get("JAXK3_DROPIN_OPS", "all_gather").split(",") if o)
IMPL = os.environ.get("JAXK3_DROPIN_IMPL", "ours")
JSON = os.environ.get("JAXK3_DROPIN_JSON")

# The op's name anywhere in the test's source (as the earlier measurements selected them: so
# psum_scatter and all_gather_invariant count as mentions; such cases pass either way).
# JAXK3_DROPIN_PATTERN (a regular expression) replaces it.
_MENTION = re.compile(os.environ.get("JAXK3_DROPIN_PATTERN") or "|".join(re.escape(op) for op in OPS))

_outcomes: dict[str, str] = {}
_ffi: dict[str, int] = {}
_bound: dict[str, int] = {}
_binds = [0]
_uncollected: list[str] = []  # test files that failed to import (jax API drift): none of their cases ran
_emitted = None


def pytest_configure(config):
    global _emitted
    if IMPL not in ("ours", "lax"):
        raise pytest.UsageError(f"JAXK3_DROPIN_IMPL must be ours or lax, not {IMPL!r}")
    unknown = set(OPS) - {"all_gather", "psum"}
    if unknown:
        raise pytest.UsageError(f"JAXK3_DROPIN_OPS: unknown op(s) {sorted(unknown)}")
    import jax

    from jaxk3 import collectives
    from jaxk3.collectives import lowering

    _emitted = lowering.emitted
    from jaxk3.collectives.allreduce import psum_p
    from jaxk3.collectives.gather import all_gather_p

    for prim in (all_gather_p, psum_p):  # count the binds: the trace-time decision was FFI
        def bind(*args, _bind=prim.bind, **params):
            _binds[0] += 1
            return _bind(*args, **params)
        prim.bind = bind
    if IMPL == "ours":
        for op in OPS:
            setattr(jax.lax, op, getattr(collectives, op))


_defs: dict[str, dict[tuple[str, str], str]] = {}


def _file_defs(path: str) -> dict[tuple[str, str], str]:
    """(class name or "", function name) -> source, for every function of a test file."""
    if path not in _defs:
        with open(path) as f:
            text = f.read()
        found: dict[tuple[str, str], str] = {}

        def visit(node, cls: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, child.name)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[(cls, child.name)] = ast.get_source_segment(text, child) or ""

        visit(ast.parse(text), "")
        _defs[path] = found
    return _defs[path]


def _source(item) -> str:
    """The test function's source: inspect's, plus the file's definition of the same name (a
    decorator that does not functools.wraps, such as jtu.with_explicit_mesh, hides the first;
    absl's parameterized cases are named <method><suffix>)."""
    fn = getattr(item, "function", None) or getattr(item, "obj", None)
    try:
        text = inspect.getsource(inspect.unwrap(fn))
    except (TypeError, OSError):
        text = ""
    name = getattr(item, "originalname", None) or item.name
    cls = item.cls.__name__ if getattr(item, "cls", None) is not None else ""
    defs = _file_defs(str(item.path))
    for scope in (cls, None):  # the class's own definitions first, then any of the file's
        matches = [n for (c, n) in defs if (scope is None or c == scope) and name.startswith(n)]
        if matches:
            best = max(matches, key=len)
            return text + "".join(src for (c, n), src in defs.items()
                                  if n == best and (scope is None or c == scope))
    return text


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        (keep if _MENTION.search(_source(item)) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_collectreport(report):
    if report.failed:
        _uncollected.append(report.nodeid)


def _total() -> int:
    return sum(_emitted.values()) if _emitted is not None else 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, binds = _total(), _binds[0]
    yield
    _ffi[item.nodeid] = _total() - before
    _bound[item.nodeid] = _binds[0] - binds


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed") or (
            report.when == "teardown" and report.outcome == "failed"):
        # the first non-pass wins (a failed teardown turns a pass into an error)
        if _outcomes.get(report.nodeid, "passed") == "passed":
            _outcomes[report.nodeid] = "error" if report.when == "teardown" else report.outcome


def pytest_terminal_summary(terminalreporter):
    counts = {k: sum(1 for v in _outcomes.values() if v == k) for k in ("passed", "failed", "skipped", "error")}
    ffi = sum(1 for n, c in _ffi.items() if c > 0)
    ffi_passed = sum(1 for n, c in _ffi.items() if c > 0 and _outcomes.get(n) == "passed")
    bound = sum(1 for n, c in _bound.items() if c > 0)
    import jax

    line = (f"jaxk3 drop-in: jax {jax.__version__}, ops={','.join(OPS)}, impl={IMPL}: "
            f"{len(_outcomes)} selected, {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['error']} errors, {counts['skipped']} skipped; FFI path in {ffi} "
            f"({ffi_passed} of them passed); jaxk3 primitive bound in {bound}"
            + (f"; {len(_uncollected)} file(s) not collected" if _uncollected else ""))
    terminalreporter.write_sep("=", line)
    for n in _uncollected:
        terminalreporter.write_line(f"  NOT COLLECTED (import error): {n}")
    for n, o in sorted(_outcomes.items()):
        if o in ("failed", "error"):
            terminalreporter.write_line(f"  {o.upper()}: {n}")
    if JSON:
        with open(JSON, "w") as f:
            json.dump({"jax": jax.__version__, "ops": list(OPS), "impl": IMPL, "counts": counts,
                       "ffi_tests": ffi, "bound_tests": bound, "not_collected": _uncollected,
                       "tests": {n: {"outcome": o, "ffi_calls": _ffi.get(n, 0), "binds": _bound.get(n, 0)}
                                                    for n, o in sorted(_outcomes.items())}}, f, indent=1)
