"""The import rule of docs/ARCHITECTURE.md ("Layers and the import rule"), read from the source:
every `import` and `from ... import` in jaxk3/, function-level ones included, must point to a
module of the same layer or a lower one, and the module graph has no circle.

    0  config and params     _compat, config, params, sharding, mxfp4, tokenizer
    1  collectives, kernels  jaxk3.collectives.*, jaxk3.kernels.*
    2  layers                jaxk3.layers.*
    3  model                 model, distributed
    4  generation, checkpoint
    5  engine                engine (Model, load_model), the package jaxk3 itself
    6  tools and cli         jaxk3.tools.*, jaxk3.cli.*

Within a layer, collectives and kernels do not import each other; kernels import nothing from
layers; the product (layers 0-5) imports no tool.
"""
from __future__ import annotations

import ast
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxk3"
EXTENSION = "jaxk3._ffi"  # the compiled nanobind module: a leaf

LAYERS = [  # (layer, module prefixes); the first match of the longest prefix wins
    (0, ("jaxk3._compat", "jaxk3.config", "jaxk3.params", "jaxk3.sharding", "jaxk3.mxfp4", "jaxk3.tokenizer")),
    (1, ("jaxk3.collectives", "jaxk3.kernels")),
    (2, ("jaxk3.layers",)),
    (3, ("jaxk3.model", "jaxk3.distributed")),
    (4, ("jaxk3.generation", "jaxk3.checkpoint")),
    (5, ("jaxk3.engine",)),
    (6, ("jaxk3.tools", "jaxk3.cli")),
]
PACKAGE_LAYER = 5  # jaxk3/__init__.py: exports the engine's names
SIBLINGS_APART = {("jaxk3.collectives", "jaxk3.kernels"), ("jaxk3.kernels", "jaxk3.collectives")}


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def layer(module: str) -> int:
    if module == "jaxk3":
        return PACKAGE_LAYER
    best = None
    for n, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (n, p)
    if best is None:
        raise AssertionError(f"{module}: not in any layer of docs/ARCHITECTURE.md; add it to LAYERS")
    return best[0]


def imports(mods: dict[str, pathlib.Path]) -> dict[str, set[tuple[str, int]]]:
    """module -> {(imported jaxk3 module, line)}, every import statement anywhere in the file."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[tuple[str, int]]] = {}
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                full = [f"{base}.{a.name}" for a in node.names]
                targets = [f if f in mods or f == EXTENSION else base for f in full]
            for t in targets:
                if not t.startswith("jaxk3") or t == EXTENSION or t.startswith(EXTENSION + "."):
                    continue
                r = resolve(t)
                if r and r != m:
                    found.add((r, node.lineno))
        edges[m] = found
    return edges


def circles(edges: dict[str, set[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for m in modules():
        layer(m)


def test_no_import_circles():
    found = circles(imports(modules()))
    assert not found, f"import circles: {found}"


def test_no_upward_imports():
    mods = modules()
    bad = []
    for m, targets in imports(mods).items():
        for t, line in sorted(targets):
            if m == "jaxk3" and t.startswith("jaxk3."):  # the package exports its layers' names
                if layer(t) <= PACKAGE_LAYER:
                    continue
            if layer(t) > layer(m):
                bad.append(f"{mods[m].relative_to(ROOT.parent)}:{line} {m} (layer {layer(m)}) imports {t} "
                           f"(layer {layer(t)})")
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_collectives_and_kernels_apart():
    bad = [(m, t) for m, targets in imports(modules()).items() for t, _ in targets
           if (m.rpartition(".")[0] or m, t.rpartition(".")[0] or t) in SIBLINGS_APART
           or (".".join(m.split(".")[:2]), ".".join(t.split(".")[:2])) in SIBLINGS_APART]
    assert not bad, f"collectives and kernels import each other: {bad}"


def test_the_rule_catches_a_violation(tmp_path):
    """The checker itself: a kernel that imports a layer, and a circle, are both found."""
    pkg = tmp_path / "jaxk3"
    for d in ("kernels", "layers"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "k.py").write_text("def f():\n    from jaxk3.layers import l\n")
    (pkg / "layers" / "l.py").write_text("from jaxk3.kernels import k\n")
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        with pytest.raises(AssertionError, match="layer 1.*imports jaxk3.layers.l"):
            test_no_upward_imports()
        with pytest.raises(AssertionError, match="circles"):
            test_no_import_circles()
    finally:
        ROOT = saved


def test_product_imports_no_tool():
    """`import jaxk3`, `jaxk3.collectives` and `jaxk3.kernels` (the product's surface) load no module of
    jaxk3.tools or jaxk3.cli (checked in a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys, jaxk3, jaxk3.collectives, jaxk3.kernels; "
            "bad = [m for m in sys.modules if m.startswith(('jaxk3.tools', 'jaxk3.cli'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
