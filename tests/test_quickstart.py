"""The README's quick start, run as written: its lines between the `quickstart:begin` / `quickstart:end`
markers (so the test and the README cannot drift), in bash with `set -e`, in a copy of this working
tree, from a fresh virtual environment the lines themselves make (`python3 -m venv .venv`).  The last
line, `jaxk3 generate` on the random tiny checkpoint, must print new token ids.

Why it is slow and marked so: pip installs jax, the build tools and the checkpoint extras into the
new environment (from pip's cache and the local wheel indexes where it can: the test pins jax and
jaxlib to the versions already installed here, so pip reuses those files instead of fetching
others), then builds the C++ extension from scratch with the CUDA handlers skipped (JAXK3_CUDA=OFF,
the README's own switch: compiling them for sm_90 when nvcc is present takes longer than the rest
together, and the quick start runs on CPU), and the last line compiles the tiny model.  Measured
2026-12-01 on the 2-core machine: 2 min of CPU in all, 6 min of wall time while other jobs held a
load average of 11 (about 3 min when it has the cores to itself); bounded at 15 minutes.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- quickstart:begin", "<!-- quickstart:end -->"


def quickstart_lines(readme: str) -> list[str]:
    """The shell lines of the fenced block between the markers, comments kept (bash ignores them)."""
    start = readme.index(BEGIN)
    block = readme[start:readme.index(END, start)]
    m = re.search(r"```bash\n(.*?)```", block, re.S)
    assert m, "the quick start markers must hold one ```bash block"
    return [line for line in m.group(1).splitlines() if line.strip()]


def test_readme_quickstart_block_is_found():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = quickstart_lines(f.read())
    assert lines[0].startswith("python3 -m venv") and any("pip install --no-build-isolation" in x for x in lines)
    assert any(x.startswith("jaxk3 init-checkpoint") for x in lines) and lines[-1].startswith("jaxk3 generate")


def _copy_tree(dest: str) -> None:
    """This working tree's tracked and untracked (not ignored) files, as a clone would have them."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


@pytest.mark.slow
def test_readme_quickstart_runs_as_written(tmp_path):
    import jax
    import jaxlib

    with open(os.path.join(ROOT, "README.md")) as f:
        lines = quickstart_lines(f.read())
    work = tmp_path / "jaxk3"
    _copy_tree(str(work))
    pins = tmp_path / "pins.txt"  # reuse the jax already downloaded here (the local index / pip's cache)
    pins.write_text(f"jax=={jax.__version__}\njaxlib=={jaxlib.__version__}\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "VIRTUAL_ENV", "PYTHONPATH", "PYTEST_CURRENT_TEST")}
    env.update(PIP_CONSTRAINT=str(pins), PIP_DISABLE_PIP_VERSION_CHECK="1", JAXK3_CUDA="OFF")
    script = "set -euxo pipefail\n" + "\n".join(lines) + "\n"
    try:
        r = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        cfg = work / ".venv" / "pyvenv.cfg"
        fresh = cfg.exists() and sys.prefix not in cfg.read_text()
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the new venv holds ~1 GB (jaxlib): not kept in pytest's tmp
    log = f"--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-6000:]}"
    assert r.returncode == 0, log
    assert re.search(r"^FFI handlers: cpu=yes", r.stdout, re.M), log  # jaxk3 info: the extension imported
    assert "wrote ./tiny-k3: a random Kimi-K3 checkpoint" in r.stdout, log
    new = re.search(r"^new ids: ([0-9,]+)$", r.stdout, re.M)
    assert new and len(new.group(1).split(",")) == 8, log
    assert "Traceback" not in r.stderr, log
    assert fresh  # the venv the lines made, not this one
