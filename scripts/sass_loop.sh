#!/usr/bin/env bash
# A kernel's inner loop counted in SASS without a GPU (scripts/sass_loop.py): the Triton IR lowered by the project's
# venv, compiled and disassembled by PyPI's `triton` in a venv of its own (made once under $SASS_VENV, ~150 MB; needs
# the network the first time).  Prints each kernel's registers, spills, layout conversions and loops' mix per weight.
#   scripts/sass_loop.sh moe_experts --preset k3 --tp 2 --batch 1 --config scale=group,x_f32=1
set -euo pipefail
cd "$(dirname "$0")/.."
PYBIN=${PYBIN:-.venv/bin/python}
SASS_VENV=${SASS_VENV:-/tmp/jaxk3_sass_venv}
TRITON_SPEC=${TRITON_SPEC:-triton==3.4.0}  # the one whose dialects parsed the Triton IR of jax 0.10.2's Pallas
OUT=${OUT:-out/sass}
if [ ! -x "$SASS_VENV/bin/python" ]; then
  python3 -m venv "$SASS_VENV"
  "$SASS_VENV/bin/python" -m pip install -q --disable-pip-version-check "$TRITON_SPEC"
fi
for f in $("$PYBIN" scripts/sass_loop.py dump "$OUT" "$@"); do
  "$SASS_VENV/bin/python" scripts/sass_loop.py count "$f"
done
