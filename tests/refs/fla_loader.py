"""Load fla-core's pure-torch reference files by path, without importing `fla` (its __init__ imports triton)."""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType


def load_fla_file(relpath: str) -> ModuleType:
    """`relpath` inside the installed fla package, e.g. "ops/kda/naive.py"."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla-core is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], relpath)
    name = "fla_naive_" + relpath.replace("/", "_").removesuffix(".py")
    mod_spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod
