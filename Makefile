# The README's commands. Each works on a fresh clone: it creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CORE_SOURCES := $(shell find csrc/core -type f) CMakeLists.txt pyproject.toml
OUT ?= out/gpu-check
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: setup test demo stubs bench gpu-check clean

setup: $(VENV)/.installed

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned and installed first, so that nothing resolves it unpinned. The pin fixes the
# version, not the build: pip takes what its index serves (PyPI on Linux x86_64: the CUDA build).
# TORCH_INDEX=https://download.pytorch.org/whl/cpu (or .../cu128, ...) chooses the build.
# The build backend is installed beside it so the extension builds without build isolation.
$(VENV)/.installed: $(VENV)/bin/python $(CORE_SOURCES)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install --quiet "scikit-build-core>=0.10" "nanobind>=2.4" cmake ninja
	$(PIP) install --quiet --no-build-isolation -e '.[test]'
	touch $@

test: setup
	$(VENV)/bin/pytest -q -x --durations=10

demo: setup
	bash examples/demo.sh

# Regenerate the committed type stubs of the C++ extension.
stubs: setup
	$(PY) -m nanobind.stubgen -m kvtool._core -o kvtool/_core.pyi

bench: setup
	$(PY) bench/cache_manager.py --output results/cache_manager.md
	$(PY) bench/ttft_cpu.py --output results/ttft_cpu.md

# On a GPU machine without a package registry (torch, CuPy, nanobind, scikit-build-core preinstalled).
gpu-check:
	OUT=$(OUT) bash scripts/gpu_check.sh

clean:
	rm -rf build $(VENV) .pytest_cache
