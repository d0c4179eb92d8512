# jaxk3: every target sets up its own virtual environment on a fresh machine.
#   make demo   the embedded default job: a tiny random K3 model on 8 CPU devices + gather verdict
#   make test   the test suite (8 fake CPU devices)
#   make bench  jaxk3 bench gather on 8 CPU devices, JSON in out/
#   make build  rebuild the C++/CUDA extension after editing ffi/
#   make aot    .venv-aot: jax $(AOT_JAX) with its CUDA plugin, to compile for an H200 without one
#               (jaxk3/tools/aot.py: `jaxk3 bench decode --census --target h200`)
#   make aot-test  the deviceless compile tests (tests/test_aot.py) in .venv-aot
# Variables: PY (interpreter for the venv), VENV (its folder), ORACLES=1|0 (torch, transformers
# and fla-core for the reference tests; 0 skips those tests with their reason), JAXK3_CUDA
# (AUTO|ON|OFF: build the CUDA handlers when nvcc is found / require it / never), PYTEST_ARGS (more
# pytest arguments, e.g. a -k filter), TEST_WORKERS (pytest-xdist processes, a test file each at a
# time; 2 for the 2-core CI machine, where one suite alone keeps about 1.3 cores busy).

PY ?= python3
VENV ?= .venv
ORACLES ?= 1
JAX_SPEC ?= jax
JAXK3_CUDA ?= AUTO
TEST_WORKERS ?= 2
# The deviceless compile's environment: the device image's jax (docs/PERF.md records it with every figure) with the CUDA
# plugin alone (no CUDA libraries: nothing runs; XLA assembles PTX with the host's ptxas, CUDA 13 here as on the
# device), on Python 3.12 (PyPI has no jax 0.11 for this machine's 3.11), its extension built apart from
# .venv312's (build/aot-*).
AOT_JAX ?= 0.11.2
AOT_PY ?= env PYENV_VERSION=3.12.1 python3.12
AOT_VENV ?= .venv-aot
SKB_ARGS ?=
export JAXK3_CUDA
PYBIN := $(VENV)/bin/python
STAMP := $(VENV)/.jaxk3-installed
TORCH_WHEEL := $(wildcard /opt/wheels/torch-2.13.0+cpu-cp311-*.whl)
PIP := $(PYBIN) -m pip install -q --disable-pip-version-check
EXTRA_SPECS ?=

.PHONY: demo test bench build venv clean aot aot-test FORCE

venv: $(STAMP)

$(VENV)/bin/python:
	$(PY) -m venv $(VENV)

# The requirement specs this venv was made with: a change to them (AOT_JAX, JAX_SPEC) remakes .deps.
$(VENV)/.specs: FORCE | $(VENV)/bin/python
	@echo '$(JAX_SPEC) $(EXTRA_SPECS)' | cmp -s - $@ || echo '$(JAX_SPEC) $(EXTRA_SPECS)' > $@

$(VENV)/.deps: $(VENV)/bin/python pyproject.toml $(VENV)/.specs
	$(PIP) "$(JAX_SPEC)" $(foreach s,$(EXTRA_SPECS),"$(s)") numpy ml_dtypes "scikit-build-core>=0.10" "nanobind>=2.4" cmake "pytest>=8" "pytest-xdist>=3.5" safetensors matplotlib tqdm tiktoken absl-py
ifeq ($(ORACLES),1)
	@# torch: the CPU build that lies on local disk (Python 3.11); else PyPI's CPU index is not
	@# reachable here, so the oracle tests need ORACLES=0 on other Pythons.
	$(PIP) $(if $(TORCH_WHEEL),$(TORCH_WHEEL),torch) "transformers==5.23.0" einops
	$(PIP) --no-deps "fla-core==0.6.0"
	@# compressed-tensors: the MXFP4 unpacking oracle (needs torch; its other deps are small)
	$(PIP) "compressed-tensors==0.20.1"
endif
	touch $@

$(STAMP): $(VENV)/.deps CMakeLists.txt $(wildcard ffi/*)
	$(PIP) --no-build-isolation --no-deps $(SKB_ARGS) -e .
	touch $@

build:
	$(PIP) --no-build-isolation --no-deps $(SKB_ARGS) -e .
	touch $(STAMP)

test: $(STAMP)
	$(PYBIN) -m pytest -q -rs --durations=15 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/jaxk3 demo --cpu-devices 8

bench: $(STAMP)
	mkdir -p out
	$(VENV)/bin/jaxk3 bench gather --cpu-devices 8 --json out/bench_gather_cpu8.json

AOT_MAKE = PY="$(AOT_PY)" VENV=$(AOT_VENV) ORACLES=0 JAX_SPEC="jax==$(AOT_JAX)" \
	EXTRA_SPECS="jax-cuda13-plugin==$(AOT_JAX)" SKB_ARGS="-C build-dir=build/aot-{wheel_tag}"

aot:
	$(MAKE) venv $(AOT_MAKE)

aot-test: aot
	JAXK3_AOT_REQUIRED=1 $(AOT_VENV)/bin/python -m pytest -q -rs --disable-warnings tests/test_aot.py $(PYTEST_ARGS)

clean:
	rm -rf build .venv .venv312 $(AOT_VENV) out
