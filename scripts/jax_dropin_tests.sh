#!/usr/bin/env bash
# JAX's own tests as the spec of jaxk3's drop-in collectives: runs the test cases of a JAX test
# checkout that mention an op (all_gather, psum) with jax.lax.<op> replaced by
# jaxk3.collectives.<op>, on 8 fake CPU devices, and counts pass/fail/skip and the tests that
# took the FFI path. Fetches nothing: give it a checkout of jax's tests at the tag of the
# installed jax (docs/COLLECTIVES.md, "JAX's own tests").
#
# usage: scripts/jax_dropin_tests.sh JAX_CHECKOUT [options] [-- pytest args]
#   JAX_CHECKOUT      a directory holding jax's tests/ (and, optionally, the tag's conftest.py
#                     and pyproject.toml, whose pytest settings are then used, as jax's CI does)
#   --python PY       the interpreter (default: .venv/bin/python of this repository)
#   --ops OPS         comma-separated, of all_gather and psum (default: all_gather)
#   --impl ours|lax   ours: lax's ops replaced (default); lax: nothing replaced (the baseline)
#   --files "F ..."   test files relative to JAX_CHECKOUT (default: every tests/*_test.py that
#                     mentions an op)
#   --pattern RE      keep the cases whose source matches RE instead (default: an op's name)
#   --json FILE       per-test outcomes and FFI-call counts
# The summary line starts with "jaxk3 drop-in:". Needs absl-py (jax's test utilities); installs
# it into PY's environment with pip if it is missing.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
[[ $# -ge 1 ]] || { sed -n '2,21p' "${BASH_SOURCE[0]}"; exit 2; }
checkout="$(cd "$1" && pwd)"; shift
py="$repo/.venv/bin/python"; ops="all_gather"; impl="ours"; files=""; json=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) py="$2"; shift 2 ;;
    --ops) ops="$2"; shift 2 ;;
    --impl) impl="$2"; shift 2 ;;
    --files) files="$2"; shift 2 ;;
    --json) json="$(realpath -m "$2")"; shift 2 ;;
    --pattern) export JAXK3_DROPIN_PATTERN="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
[[ -d "$checkout/tests" ]] || { echo "$checkout has no tests/ directory" >&2; exit 2; }
if [[ "$py" == */* ]]; then py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"; else py="$(command -v "$py")"; fi

"$py" -c "import absl" 2>/dev/null || "$py" -m pip install -q absl-py

if [[ -z "$files" ]]; then
  pattern="$(echo "$ops" | sed 's/,/\\|/g')"
  files="$(cd "$checkout" && grep -l "$pattern" tests/*_test.py | tr '\n' ' ')"
fi

config=()
[[ -f "$checkout/pyproject.toml" ]] && config=(-c "$checkout/pyproject.toml")

export XLA_FLAGS="--xla_force_host_platform_device_count=8${XLA_FLAGS:+ $XLA_FLAGS}"
export JAX_PLATFORMS=cpu
export JAXK3_DROPIN_OPS="$ops" JAXK3_DROPIN_IMPL="$impl" JAXK3_DROPIN_JSON="$json"
export PYTHONPATH="$here:$repo${PYTHONPATH:+:$PYTHONPATH}"
cd "$checkout"
# shellcheck disable=SC2086
exec "$py" -m pytest -p jax_dropin_plugin "${config[@]}" --rootdir="$checkout" -q -rfE \
  -p no:cacheprovider \
  --continue-on-collection-errors $files "$@"
